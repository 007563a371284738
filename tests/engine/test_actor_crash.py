"""An actor that dies ends every live stream with an error, and the engine reports itself dead."""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine, EngineDeadError
from tests.engine.util import greedy, tiny_config
from tests.frontends.conftest import serving


async def test_a_crashed_scheduler_ends_every_stream_with_an_error(tiny_model):
    async with asyncio.timeout(30):
        async with serving(tiny_model, tiny_config(policy="continuous", max_num_seqs=1)) as (engine, client):
            running = await engine.submit([3, 4, 5], greedy(200))
            waiting = await engine.submit([6, 7, 8], greedy(5))  # max_num_seqs=1: it waits
            stream = engine.stream(running)
            await anext(stream)  # it is running

            def broken(s):
                raise RuntimeError("policy bug")

            engine.scheduler.policy.schedule = broken
            rest = [o async for o in stream]
            assert rest[-1].finished and rest[-1].finish_reason == "error" and "policy bug" in rest[-1].error
            outs = [o async for o in engine.stream(waiting)]
            assert len(outs) == 1 and outs[0].finish_reason == "error"
            assert "scheduler crashed" in engine.dead
            with pytest.raises(EngineDeadError):
                await engine.submit([1, 2], greedy(2))
            health = await client.get("/health")
            assert health.status == 503 and (await health.json())["status"] == "dead"
            assert not engine._live
