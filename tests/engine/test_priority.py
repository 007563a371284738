"""Priority aging: a waiting request gains a priority level per `priority_aging_s` waited."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import EngineConfig
from engine.block_manager import KVFigures
from engine.kv_ledger import KVLedger
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler(aging_s: float, clock: Clock) -> Scheduler:
    kv = SimpleNamespace(figures=KVFigures(8, 8, 0.0, 0.0, 0))
    policy = SimpleNamespace(name="continuous")
    return Scheduler(policy, kv, KVLedger(8, 4), execute=None, publish=None, pad_token_id=0,
                     priority_aging_s=aging_s, clock=clock)


def request(i: int, priority: int, arrived: float) -> Request:
    req = Request(f"r{i}", [1, 2], SamplingParams(priority=priority), None, None, i)
    req.arrival_time = arrived
    return req


@pytest.mark.parametrize("aging_s, waited_s, low_first", [
    (0.0, 1e6, False),  # strict: priority 5 never overtakes priority 0, however long it waits
    (10.0, 49.0, False),  # 4 levels gained: still behind
    (10.0, 51.0, True),  # 5 levels gained: level with 0 and older, so first
])
def test_aging_reorders_the_waiting_queue(aging_s, waited_s, low_first):
    clock = Clock()
    s = scheduler(aging_s, clock)
    low = request(0, priority=5, arrived=clock.now - waited_s)
    high = request(1, priority=0, arrived=clock.now)
    for req in (high, low):
        s._enqueue(req)
    assert s.waiting == [high, low]  # inserted by (priority, arrival)
    if aging_s:
        s._age_waiting()
    assert (s.waiting[0] is low) == low_first


def test_aging_config():
    assert EngineConfig().scheduler.priority_aging_s == 0.0
    assert EngineConfig.from_dict({"scheduler": {"priority_aging_s": 30}}).scheduler.priority_aging_s == 30.0
    with pytest.raises(ValueError, match="priority_aging_s"):
        EngineConfig.from_dict({"scheduler": {"priority_aging_s": -1}})
