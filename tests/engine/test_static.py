"""Static batching as a faithful baseline: a batch's requests are published with the step
they finish in, and padding is computed where a padded batch computes it."""

from __future__ import annotations

import asyncio

from engine import Engine
from tests.engine.util import StepRecorder, assert_drained, greedy, run_all, run_request, tiny_config


async def test_the_last_batch_is_published_when_it_finishes(tiny_model):
    async with asyncio.timeout(60):
        cfg = tiny_config(policy="static", batch_timeout_ms=60_000, max_num_seqs=2)  # starts when both are in
        async with Engine(cfg, loaded=tiny_model) as engine:
            recorder = await StepRecorder(engine).start()
            results = await run_all(engine, [[3, 4, 5], [6, 7, 8, 9]], [greedy(3), greedy(6)])
            records = await recorder.caught_up()
            # no later batch ever runs: the finish records came with the batch's last step
            assert {f.request_id for f in records[-1].finished} == {r.request_id for r in results}
            assert records[-1].step == engine.scheduler.step
            await assert_drained(engine)


async def test_an_abort_while_idle_is_published_at_once(tiny_model):
    cfg = tiny_config(policy="static", batch_timeout_ms=60_000, max_num_seqs=8)  # the batch never fills
    async with asyncio.timeout(30):
        async with Engine(cfg, loaded=tiny_model) as engine:
            recorder = await StepRecorder(engine).start()
            rid = await engine.submit([3, 4], greedy(4))
            await engine.abort(rid)
            while not any(f.request_id == rid for r in recorder.records for f in r.finished):
                await asyncio.sleep(0.005)
            record = next(r for r in recorder.records if r.finished)
            assert record.is_idle and record.step == 0 and record.finished[0].finish_reason == "abort"
            assert engine.scheduler.step == 0  # no step ran for it


async def test_padding_attends_in_place(tiny_model):
    plans = []
    cfg = tiny_config(policy="static", batch_timeout_ms=60_000, max_num_seqs=2)
    async with asyncio.timeout(60):
        async with Engine(cfg, loaded=tiny_model, fault_hook=plans.append) as engine:
            short, long = [3, 4, 5], list(range(10, 20))
            alone = (await run_all(engine, [short, short], [greedy(2), greedy(2)]))[0].token_ids
            plans.clear()
            results = await run_all(engine, [short, long], [greedy(2), greedy(5)])
            await assert_drained(engine)
    assert results[0].token_ids == alone  # padding after the prompt changes nothing it computes
    first = {it.request_id: it for it in plans[0].items}
    s, lg = first[results[0].request_id], first[results[1].request_id]
    # the short prompt is padded to the long one inside its own sequence, from position 3 on
    assert len(s.token_ids) == len(long) and s.num_padding == len(long) - len(short) and s.start_pos == 0
    assert s.block_table and lg.num_padding == 0
    # once finished, the short request keeps one pad token per step at its own next position,
    # attending to its whole context
    pads = [it for p in plans[2:] for it in p.items if it.request_id == results[0].request_id]
    assert pads and all(it.kind == "padding" and it.num_padding == 1 and it.block_table for it in pads)
    assert all(it.start_pos == len(short) + 1 for it in pads)  # prompt + 2 outputs, last not yet fed
