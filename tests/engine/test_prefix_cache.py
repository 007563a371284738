"""Prefix caching end to end: a request sharing a long prefix with an earlier one computes
only its new tokens (whole cached blocks are skipped) and produces exactly the output of a
run without prefix caching."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import Engine
from tests.engine.util import StepRecorder, assert_drained, greedy, run_request, tiny_config

BLOCK = 16
rng = random.Random(7)
SHARED = [rng.randrange(3, 259) for _ in range(100)]
FIRST = SHARED + [rng.randrange(3, 259) for _ in range(10)]
SECOND = SHARED + [rng.randrange(3, 259) for _ in range(20)]
N = 12


def prefill_items(records, request_id):
    return [(rec, it) for rec in records for it in rec.items if it.request_id == request_id and it.kind == "prefill"]


@pytest.fixture(scope="module")
def uncached(tiny_model):
    async def go():
        cfg = tiny_config(policy="continuous", block_size=BLOCK, enable_prefix_caching=False)
        async with Engine(cfg, loaded=tiny_model) as engine:
            first = await run_request(engine, FIRST, greedy(N))
            second = await run_request(engine, SECOND, greedy(N))
            assert second.final.num_cached_tokens == 0
        return first.token_ids, second.token_ids

    return asyncio.run(go())


@pytest.mark.parametrize("policy,chunk", [("continuous", 192), ("chunked", 192), ("chunked", 32)])
async def test_second_request_computes_only_new_tokens(tiny_model, uncached, policy, chunk):
    cfg = tiny_config(policy=policy, block_size=BLOCK, chunk_size=chunk, max_num_batched_tokens=64 if chunk == 32 else 256)
    async with asyncio.timeout(30):
        async with Engine(cfg, loaded=tiny_model) as engine:
            recorder = await StepRecorder(engine).start()
            first = await run_request(engine, FIRST, greedy(N))
            second = await run_request(engine, SECOND, greedy(N))
            records = await recorder.caught_up()
            assert first.final.num_cached_tokens == 0
            assert second.final.num_cached_tokens == 96  # 6 whole blocks of the 100 shared tokens
            assert (first.token_ids, second.token_ids) == uncached
            first_prefill = prefill_items(records, first.request_id)
            second_prefill = prefill_items(records, second.request_id)
            assert sum(it.num_tokens for _, it in first_prefill) == len(FIRST)
            # the second request's prefill starts at position 96 and covers only the rest
            assert second_prefill[0][1].position == 96
            assert sum(it.num_tokens for _, it in second_prefill) == len(SECOND) - 96
            assert second_prefill[0][0].num_cached_tokens == 96  # the admission step's record
            assert sum(rec.num_cached_tokens for rec in records) == 96
            assert engine.snapshot().prefix_cache_hit_rate > 0
            await assert_drained(engine)
            recorder.stop()


async def test_concurrent_requests_share_prefix_blocks(tiny_model, uncached):
    """The second request arrives while the first still decodes: it shares the first's live
    blocks (refcount 2) and both still produce the uncached outputs."""
    cfg = tiny_config(policy="chunked", block_size=BLOCK)
    async with asyncio.timeout(30):
        async with Engine(cfg, loaded=tiny_model) as engine:
            recorder = await StepRecorder(engine).start()
            first_id = await engine.submit(FIRST, greedy(N))
            first_out = []
            second_task = None
            async for out in engine.stream(first_id):
                first_out += out.token_ids
                if second_task is None:  # the first token is out: its prompt blocks are committed
                    second_task = asyncio.create_task(run_request(engine, SECOND, greedy(N)))
            second = await second_task
            assert second.final.num_cached_tokens == 96
            assert (first_out, second.token_ids) == uncached
            records = await recorder.caught_up()
            together = [r for r in records if {first_id, second.request_id} <= {it.request_id for it in r.items}]
            assert together, "the two requests never ran in the same step"
            await assert_drained(engine)
            recorder.stop()


async def test_static_policy_does_not_use_the_prefix_cache(tiny_model, uncached):
    cfg = tiny_config(policy="static", block_size=BLOCK)
    async with Engine(cfg, loaded=tiny_model) as engine:
        first = await run_request(engine, FIRST, greedy(N))
        second = await run_request(engine, SECOND, greedy(N))
        assert second.final.num_cached_tokens == 0
        assert (first.token_ids, second.token_ids) == uncached
        await assert_drained(engine)


@pytest.mark.parametrize(("policy", "caching", "looked_up"), [("chunked", True, True), ("chunked", False, False),
                                                              ("static", True, False)])
async def test_prefix_queries_count_only_where_the_cache_is_looked_up(tiny_model, uncached, policy, caching, looked_up):
    """With the cache off, steps reported their admissions' tokens as looked up (0 % hits on
    vllm:prefix_cache_queries_total where vLLM records no queries)."""
    cfg = tiny_config(policy=policy, block_size=BLOCK, enable_prefix_caching=caching)
    async with Engine(cfg, loaded=tiny_model) as engine:
        recorder = await StepRecorder(engine).start()
        await run_request(engine, FIRST, greedy(N))
        second = await run_request(engine, SECOND, greedy(N))
        records = await recorder.caught_up()
        recorder.stop()
    queried = sum(r.num_prefix_queries for r in records)
    assert queried == (len(FIRST) + len(SECOND) if looked_up else 0)
    assert (second.final.num_cached_tokens > 0) == looked_up
