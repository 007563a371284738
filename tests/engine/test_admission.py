"""Admission: the waiting limit holds while a step runs, live ids are unique, and the engine
forgets every request however it ends (no per-request state left behind)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import Engine, QueueFullError, RequestError
from tests.engine.util import assert_drained, greedy, run_request, tiny_config


class HeldStep:
    """A fault hook that holds step `step` in the executor's thread until released."""

    def __init__(self, step: int = 1):
        self.step = step
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, plan) -> None:
        if plan.step == self.step:
            self.entered.set()
            self.release.wait(timeout=60)


async def test_max_waiting_holds_while_a_step_runs(tiny_model):
    hold = HeldStep()
    cfg = tiny_config(policy="continuous", max_waiting=4, max_num_seqs=64)
    async with Engine(cfg, loaded=tiny_model, fault_hook=hold) as engine:
        try:
            first = asyncio.create_task(run_request(engine, [3, 4, 5], greedy(4)))
            await asyncio.to_thread(hold.entered.wait, 30)  # step 1 runs and is held
            accepted, refused = [], 0
            for i in range(30):
                try:
                    accepted.append(await engine.submit([6, 7, 8 + i], greedy(2)))
                except QueueFullError:
                    refused += 1
            assert len(accepted) == 4 and refused == 26
            assert engine.scheduler.num_queued == 4
        finally:
            hold.release.set()
        assert (await first).finish_reason == "length"
        for rid in accepted:
            outs = [o async for o in engine.stream(rid)]
            assert outs[-1].finish_reason == "length"
        await assert_drained(engine)


async def test_max_waiting_holds_for_schema_requests_arriving_together(tiny_model):
    """They are admitted in parallel tasks, and each was counted only once its prompt was
    tokenized: three long-prompt schema requests all passed the check of a 1-request queue."""
    from engine import StructuredOutput
    from engine.chat_prompt import LONG_PROMPT_CHARS

    hold = HeldStep()
    cfg = tiny_config(policy="continuous", max_waiting=1, max_num_seqs=64)
    params = greedy(2, structured_output=StructuredOutput.from_schema({"type": "boolean"}))
    long = "a " * (LONG_PROMPT_CHARS // 2 + 10)  # tokenized on intake's thread: an await
    async with Engine(cfg, loaded=tiny_model, fault_hook=hold) as engine:
        try:
            first = asyncio.create_task(run_request(engine, [3, 4, 5], greedy(4)))
            await asyncio.to_thread(hold.entered.wait, 30)  # step 1 runs and is held
            results = await asyncio.gather(*(engine.submit(long, params) for _ in range(3)), return_exceptions=True)
            accepted = [r for r in results if isinstance(r, str)]
            assert len(accepted) == 1 and sum(isinstance(r, QueueFullError) for r in results) == 2, results
            assert engine.scheduler.num_queued == 1
        finally:
            hold.release.set()
        await first
        assert [o async for o in engine.stream(accepted[0])][-1].finished
        await assert_drained(engine)


async def test_a_live_request_id_cannot_be_reused(tiny_model):
    async with asyncio.timeout(60):
        async with Engine(tiny_config(policy="continuous", max_num_seqs=1), loaded=tiny_model) as engine:
            await engine.submit([3, 4, 5], greedy(20), request_id="dup")
            with pytest.raises(RequestError, match="already in use") as err:
                await engine.submit([6, 7], greedy(3), request_id="dup")
            assert err.value.param == "request_id"
            first = [o async for o in engine.stream("dup")]  # the first is undisturbed
            assert first[-1].finish_reason == "length" and sum(len(o.token_ids) for o in first) == 20
            again = await run_request(engine, [6, 7], greedy(3), request_id="dup")  # free once read
            assert again.finish_reason == "length"
            await assert_drained(engine)
            assert not engine._live and not engine.scheduler.requests


async def test_every_exit_path_forgets_the_request(tiny_model):
    """1,000 requests ended every way a library user can end one: the maps end up empty."""
    cfg = tiny_config(policy="chunked", max_num_seqs=64, max_waiting=2000)
    async with asyncio.timeout(240):
        async with Engine(cfg, loaded=tiny_model) as engine:
            async def one(i: int) -> None:
                rid = await engine.submit([3 + i % 200, 4, 5], greedy(3))
                match i % 4:
                    case 0:  # read to the end
                        assert [o async for o in engine.stream(rid)][-1].finished
                    case 1:  # aborted, never read
                        await engine.abort(rid)
                    case 2:  # read a little, then walk away (aborts)
                        async for _ in engine.stream(rid):
                            break
                    case 3:  # read without stream(): the outputs buffer straight
                        outputs = engine._live[rid]
                        while not (await outputs.get()).finished:
                            pass

            await asyncio.gather(*(one(i) for i in range(1000)))
            await assert_drained(engine)
            assert not engine._live
            assert not engine.scheduler.requests and not engine.scheduler.waiting and not engine.scheduler.running
            engine.block_manager.check_invariants()
