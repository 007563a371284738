"""The scheduler's bookkeeping around the block manager's grant."""

from __future__ import annotations

from engine import EngineConfig
from engine.block_manager import Admitted, BlockManager, BlockManagerClient, KVGrant
from engine.kv_ledger import KVLedger
from engine.messages import AddRequest
from engine.policies import make_policy
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler


def test_an_admission_the_pool_refuses_does_not_end_the_requests_queue_time():
    """The time was stamped when the policy planned the admission; refused, the request went
    back to waiting, and when it was admitted for real its queue time had ended long before."""
    cfg = EngineConfig.from_dict({"model": {"model": "tiny-random"}, "scheduler": {"policy": "continuous"}})
    manager = BlockManager(8, 4, True)
    s = Scheduler(make_policy("continuous", cfg), BlockManagerClient(manager), KVLedger(8, 4), execute=None,
                  publish=None, pad_token_id=0)
    req = Request("r", [3, 4, 5], SamplingParams(max_tokens=2), None, None, 0)
    s._apply(AddRequest(req))
    decisions = s.policy.schedule(s.view)
    assert [d.request for d in decisions] == [req]
    s.ledger.take()  # the step's message, answered: no room after all
    kept = s._settle(decisions, KVGrant({}, {"r": Admitted(0, 0)}, [], manager.figures))
    assert kept == [] and s.waiting == [req] and req.scheduled_time is None
