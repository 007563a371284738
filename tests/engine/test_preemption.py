"""A KV pool far smaller than the load: requests are preempted (recompute) and re-admitted,
yet every one finishes with exactly the greedy tokens of a roomy run. A request that could
never fit the pool is refused at submit without disturbing the others."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import ContextLengthError, Engine
from tests.engine.util import StepRecorder, assert_drained, greedy, run_all, run_request, tiny_config

NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 10, 20, 16
SMALL = {"num_blocks": 12, "block_size": 4}  # 48 token slots; one request needs 36


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 259) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def roomy_tokens(tiny_model) -> list[list[int]]:
    async def go():
        async with Engine(tiny_config(policy="continuous", num_blocks=256, block_size=4), loaded=tiny_model) as engine:
            results = await run_all(engine, prompts(), [greedy(MAX_TOKENS)] * NUM_REQUESTS)
        return [r.token_ids for r in results]

    return asyncio.run(go())


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
async def test_preempted_requests_finish_with_the_same_tokens(tiny_model, roomy_tokens, policy):
    cfg = tiny_config(policy=policy, max_num_batched_tokens=24, chunk_size=8, **SMALL)
    async with Engine(cfg, loaded=tiny_model) as engine:
        recorder = await StepRecorder(engine).start()
        results = await run_all(engine, prompts(), [greedy(MAX_TOKENS)] * NUM_REQUESTS, timeout=60)
        records = await recorder.caught_up()
        for i, r in enumerate(results):
            assert r.finish_reason == "length", (i, r.finish_reason, r.final.error)
            assert r.token_ids == roomy_tokens[i], f"request {i} differs after preemption"
        assert records[-1].num_preemptions > 0, "the small pool never forced a preemption"
        assert engine.snapshot().num_preemptions == records[-1].num_preemptions
        assert max(r.kv_usage for r in records) <= 1.0
        await assert_drained(engine)
        recorder.stop()


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
async def test_request_that_can_never_fit_is_refused_at_submit(tiny_model, roomy_tokens, policy):
    cfg = tiny_config(policy=policy, max_num_batched_tokens=24, chunk_size=8, **SMALL)
    capacity = SMALL["num_blocks"] * SMALL["block_size"]
    async with Engine(cfg, loaded=tiny_model) as engine:
        async with asyncio.timeout(60):
            tasks = [asyncio.create_task(run_request(engine, p, greedy(MAX_TOKENS))) for p in prompts()[:4]]
            await asyncio.sleep(0)
            with pytest.raises(ContextLengthError) as err:
                await engine.submit([5] * 40, greedy(capacity - 40 + 1))  # one token more than the pool
            assert err.value.param == "max_tokens"
            with pytest.raises(ContextLengthError):
                await engine.submit([5] * (capacity + 1), greedy(1))
            # exactly the pool's size is accepted
            exact = await run_request(engine, [5] * (capacity - 8), greedy(8))
            assert exact.finish_reason == "length" and len(exact.token_ids) == 8
            results = await asyncio.gather(*tasks)
        for i, r in enumerate(results):
            assert r.finish_reason == "length" and r.token_ids == roomy_tokens[i]
        await assert_drained(engine)


@pytest.mark.parametrize("priorities", [(0, 0), (0, 5)], ids=["fcfs", "priority"])
async def test_the_victim_is_the_lowest_priority_newest_request(tiny_model, priorities):
    """An older (or more important) request in chunked prefill and a newer one decoding: when
    the pool runs dry, the newer (less important) one is preempted — its already planned
    decode taken back — never the older prefill."""
    cfg = tiny_config(policy="chunked", num_blocks=24, block_size=2, chunk_size=4, max_num_batched_tokens=8, max_step_ms=0)
    async with asyncio.timeout(60):
        async with Engine(cfg, loaded=tiny_model) as engine:
            recorder = await StepRecorder(engine).start()
            old = asyncio.create_task(run_request(engine, list(range(3, 43)), greedy(2, priority=priorities[0])))
            await asyncio.sleep(0)
            new = asyncio.create_task(run_request(engine, [50, 51], greedy(30, priority=priorities[1])))
            old_r, new_r = await old, await new
            records = await recorder.caught_up()
            await assert_drained(engine)
    assert old_r.finish_reason == new_r.finish_reason == "length"
    assert records[-1].num_preemptions >= 1  # the pool did run dry
    starts = [it.position for r in records for it in r.items if it.request_id == old_r.request_id
              and it.kind == "prefill"]
    assert starts == sorted(set(starts)), f"the older request was preempted: prefill restarted {starts}"
    new_positions = [it.position for r in records for it in r.items if it.request_id == new_r.request_id]
    assert new_positions != sorted(new_positions)  # the newer one was the victim: it went back and recomputed
