"""(1) Soak with disconnects, in-suite: 200 streaming requests over HTTP (concurrency 64,
tiny model), 30% of the clients leaving before the first token or mid-stream. Every request
that stays gets exactly its reference text; afterwards nothing is left anywhere (queues, KV
blocks, live streams, handlers, asyncio tasks). `python examples/soak.py` runs 1000."""

from __future__ import annotations

import asyncio

from engine.block_manager import Admit, KVStep

from tests.reliability.util import assert_no_leaks, live_registry, live_server, load_soak, tiny_config

soak = load_soak()


async def test_soak_with_disconnects(tiny_model):
    options = soak.Options(requests=200, concurrency=64, disconnect_share=0.3, prompts=24, max_tokens=40, seed=11)
    lines = []
    report = await soak.soak_in_process(options, tiny_config(num_blocks=512), loaded=tiny_model, log=lines.append)
    print("\n" + report.summary())
    assert not report.failures, report.failures[:10]
    assert not report.leaks, report.leaks
    assert report.correct == report.completed == options.requests - report.num_disconnects
    assert report.disconnects["before_first_token"] >= 5 and report.disconnects["mid_stream"] >= 5
    assert report.checks["running"] == report.checks["waiting"] == report.checks["kv usage"] == 0
    assert report.checks["extra asyncio tasks"] == 0 and report.checks["live handlers"] == 0
    assert report.ok


async def test_the_leak_checks_catch_leaks(tiny_model):
    """The detector itself: a stray task, a stream the engine still tracks, KV blocks with
    an owner and a handler left in the registry are all reported."""
    async with live_server(tiny_model, tiny_config()) as (engine, frontend):
        baseline = set(asyncio.all_tasks())
        never = asyncio.Event()
        stray = asyncio.create_task(never.wait(), name="stray-task")
        engine._live["ghost"] = object()
        grant = await engine.scheduler.kv.step(KVStep([], [], [], [Admit("ghost", [5] * 40, False, 40, 40)]))
        assert grant.admitted["ghost"].num_new_tokens == 40  # 3 blocks, never freed
        registry = live_registry(frontend)
        registry._live[stray] = "ghost"
        report = soak.Report()
        await soak.check_internals(engine, frontend, baseline, report, timeout=0.2)
        found = "\n".join(report.leaks)
        for what in ("engine live streams: 1", "blocks in use: 3", "block owners: 1", "live handlers: 1",
                     "extra asyncio tasks: 1", "stray-task"):
            assert what in found, found
        registry._live.pop(stray)
        stray.cancel()
        engine._live.pop("ghost")
        await engine.scheduler.kv.step(KVStep([], ["ghost"], [], []))
        await assert_no_leaks(engine, frontend)
