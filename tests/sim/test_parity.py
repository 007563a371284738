"""The simulator makes exactly the decisions the engine's scheduler makes: the same trace, the
same step times, through (a) the simulator on its virtual clock and (b) the real Scheduler and
BlockManager on an ordinary asyncio loop with a fake executor (as tests/engine/test_step_budget.py
drives them), which injects each request once the steps run so far have covered its arrival.
Every step's composition (who gets how many tokens of which kind at which position), its
prefix-cache hits, preemptions and the cost model's prediction must match."""

from __future__ import annotations

import asyncio

import pytest

from engine.block_manager import BlockManager, BlockManagerClient, Stop
from engine.kv_ledger import KVLedger
from engine.messages import Shutdown, StepResult
from engine.output_buffer import OutputBuffer
from engine.policies import make_policy
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler, plan_shape
from engine.sim import trace as traces
from engine.sim.replica import NullDetokenizer, SimExecutor
from engine.sim.simulator import simulate
from engine.step_cost_calibration import calibrate
from tests.sim.util import CAL, config


def composition(records) -> list[tuple]:
    return [(r.step, tuple(r.items), r.num_cached_tokens, r.num_preemptions, r.num_waiting, r.num_running,
             None if r.predicted_s is None else round(r.predicted_s, 9)) for r in records if not r.is_idle]


async def reference(trace, cfg) -> list:
    """The engine's scheduler path; time is what the fake executor's steps add up to."""
    c = cfg
    manager = BlockManager(c.cache.num_blocks, c.cache.block_size, c.cache.enable_prefix_caching)
    records, now = [], 0.0
    pending = list(enumerate(trace))
    requests: list[Request] = []

    def add_due(t: float) -> None:
        while pending and pending[0][1].arrival_s <= t:
            i, r = pending.pop(0)
            params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True, priority=r.priority)
            req = Request(str(i), traces.token_ids(r, i), params, NullDetokenizer(), None, i, OutputBuffer(1 << 20), seed=0,
                          arrival_time=t)
            requests.append(req)
            sched.add(req)

    async def execute(plan):
        nonlocal now
        shape = plan_shape(plan)
        forward = CAL.forward_s(shape)
        start, now = now, now + forward + CAL.overhead_s(shape)
        add_due(now)  # arrivals while the step ran wait in the inbox when it returns
        sampled = {it.request_id: 1 for it in plan.items if it.sample}
        return StepResult(step=plan.step, sampled=sampled, start_time=start, duration_s=now - start, forward_s=forward)

    sched = Scheduler(make_policy(c.scheduler.policy, c), BlockManagerClient(manager),
                      KVLedger(c.cache.num_blocks, c.cache.block_size), execute, records.append, pad_token_id=0,
                      clock=lambda: now)
    calibrate(SimExecutor(CAL, c.cache.block_size), sched.cost, c.cache.num_blocks, 1 << 30)
    tasks = [asyncio.create_task(manager.run()), asyncio.create_task(sched.run())]
    while pending:  # the engine went idle before the next arrival: time jumps to it
        await asyncio.sleep(0.001)
        if pending and not sched.requests and sched.inbox.empty():
            now = max(now, pending[0][1].arrival_s)
            add_due(now)
    async with asyncio.timeout(120):
        for req in requests:
            while not (await req.outputs.get()).finished:
                pass
    sched.inbox.put_nowait(Shutdown())
    await tasks[1]
    manager.inbox.put_nowait(Stop())
    await tasks[0]
    return records


CASES = {
    "continuous": dict(policy="continuous"),
    "chunked-tokens": dict(policy="chunked", max_step_ms=0, max_num_batched_tokens=256, chunk_size=128),
    "chunked-time": dict(policy="chunked", max_step_ms=150, min_chunk=16, max_num_batched_tokens=1024),
    "chunked-tight-kv": dict(policy="chunked", max_step_ms=0, num_blocks=96, max_num_batched_tokens=256),
    # a batch starts with whatever has arrived: the reference's clock is the steps' sum, so a
    # batch timeout (a wait on the loop's clock) has no counterpart there
    "static": dict(policy="static", batch_timeout_ms=0, max_num_seqs=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulated_steps_are_the_engine_s_steps(case):
    cfg = config(**CASES[case])
    trace = traces.generate("sharegpt-like", seed=3, num_requests=40, rate=6.0)
    # a shared prefix for some, so prefix-cache hits are part of what must match
    trace = [traces.TraceRequest(arrival_s=r.arrival_s, prompt_tokens=r.prompt_tokens + 64, output_tokens=r.output_tokens,
                                 prefix_group=i % 3, prefix_tokens=64) if i % 2 else r for i, r in enumerate(trace)]
    trace = [r for r in trace if r.prompt_tokens + r.output_tokens <= 96 * 16]  # each fits the tight pool alone
    sim = simulate(trace, cfg, CAL, keep_steps=True)
    real = asyncio.run(reference(trace, cfg))
    assert all(t.ok for t in sim.timings)
    got, want = composition(sim.steps), composition(real)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == b
    if case == "static":
        assert any(r.num_padding_tokens for r in real), "static batching should pad"
    if case == "chunked-tight-kv":
        assert want[-1][3] > 0, "the tight pool should preempt"
    assert case == "static" or sum(r[2] for r in want) > 0, "prefix-cache hits should occur"
