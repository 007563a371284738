"""Intake: what a request becomes before the scheduler sees it."""

from __future__ import annotations

import asyncio

from engine import Engine, SamplingParams
from tests.engine.util import greedy, run_request, tiny_config


async def sample_twice(tiny_model, seed: int) -> list[list[int]]:
    runs = []
    for _ in range(2):
        async with Engine(tiny_config(policy="continuous", seed=seed), loaded=tiny_model) as engine:
            params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # no per-request seed
            runs.append((await run_request(engine, [3, 4, 5], params)).token_ids)
    return runs


async def test_the_model_seed_makes_unseeded_sampling_reproducible(tiny_model):
    async with asyncio.timeout(60):
        first, again = await sample_twice(tiny_model, seed=7)
        other, _ = await sample_twice(tiny_model, seed=8)
    assert first == again
    assert first != other


async def test_a_slow_grammar_does_not_hold_the_requests_behind_it(tiny_model, monkeypatch):
    """Intake used to await each schema's compile in line: one schema that took minutes to
    compile held every request behind it, plain ones too. It now waits in its own task."""
    import threading

    from engine import StructuredOutput
    from engine.structured.compiler import GrammarCache

    release = threading.Event()
    compile_for_real = GrammarCache._compile

    def slow_compile(self, spec):
        release.wait(30)  # on the grammar thread, as a pathological schema's compile would
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCache, "_compile", slow_compile)
    async with asyncio.timeout(60):
        async with Engine(tiny_config(max_waiting=2), loaded=tiny_model) as engine:
            schema = StructuredOutput.from_schema({"type": "boolean"})
            constrained = asyncio.create_task(run_request(engine, [3, 4], SamplingParams(max_tokens=8, temperature=0.0,
                                                                                        structured_output=schema)))
            await asyncio.sleep(0.2)  # intake has it: its grammar is compiling
            plain = await run_request(engine, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            assert plain.finish_reason == "length" and not constrained.done()
            # a request waiting for its grammar counts as waiting: max_waiting=2 holds one more
            from engine.errors import QueueFullError

            second = asyncio.create_task(engine.submit([3], SamplingParams(max_tokens=2, structured_output=schema)))
            await asyncio.sleep(0.2)
            try:
                await engine.submit([3], SamplingParams(max_tokens=2, structured_output=schema))
                raise AssertionError("a third request waiting for a grammar must be refused")
            except QueueFullError:
                pass
            release.set()
            assert (await constrained).text in ("true", "false")
            async for _ in engine.stream(await second):
                pass


def _slowed(monkeypatch, slow_schema: str):
    """Compiles of `slow_schema` wait for the returned event (on their compile thread, as a
    pathological schema's would); other schemas compile as usual."""
    import threading

    from engine.structured.compiler import GrammarCache

    release = threading.Event()
    compile_for_real = GrammarCache._compile

    def compile_(self, spec):
        if spec.json_schema == slow_schema:
            release.wait(60)
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCache, "_compile", compile_)
    return release


async def test_schema_requests_arriving_together_share_the_queue_as_plain_ones_do(tiny_model):
    """Each counted the others still being checked: three at once with room for two were all refused."""
    from engine import StructuredOutput
    from engine.errors import QueueFullError

    async with asyncio.timeout(60):
        async with Engine(tiny_config(max_waiting=2), loaded=tiny_model) as engine:
            schema = StructuredOutput.from_schema({"type": "boolean"})
            params = SamplingParams(max_tokens=4, temperature=0.0, structured_output=schema)
            outcomes = await asyncio.gather(*(engine.submit([3, 4], params) for _ in range(3)), return_exceptions=True)
            assert sum(isinstance(o, str) for o in outcomes) >= 2, outcomes
            assert all(isinstance(o, (str, QueueFullError)) for o in outcomes), outcomes
            for rid in (o for o in outcomes if isinstance(o, str)):
                async for _ in engine.stream(rid):
                    pass


async def test_a_slow_schema_holds_one_compile_thread_not_every_schema(tiny_model, monkeypatch):
    from engine import StructuredOutput

    slow = StructuredOutput.from_schema({"type": "string"})
    release = _slowed(monkeypatch, slow.json_schema)
    async with asyncio.timeout(60):
        async with Engine(tiny_config(), loaded=tiny_model) as engine:
            stuck = asyncio.create_task(engine.submit([3], SamplingParams(max_tokens=2, structured_output=slow)))
            await asyncio.sleep(0.2)
            other = StructuredOutput.from_schema({"type": "boolean"})
            result = await run_request(engine, [3, 4], SamplingParams(max_tokens=8, temperature=0.0,
                                                                      structured_output=other))
            assert result.text in ("true", "false") and not stuck.done()
            release.set()
            async for _ in engine.stream(await stuck):
                pass


async def test_an_abort_reaches_a_request_waiting_for_its_grammar(tiny_model, monkeypatch):
    """Engine.abort went straight to the scheduler, which did not have the request yet: once
    its grammar compiled the aborted request ran to the end. Now its submit is refused."""
    from engine import RequestAbortedError, StructuredOutput

    schema = StructuredOutput.from_schema({"type": "boolean"})
    release = _slowed(monkeypatch, schema.json_schema)
    async with asyncio.timeout(60):
        async with Engine(tiny_config(), loaded=tiny_model) as engine:
            params = SamplingParams(max_tokens=4, temperature=0.0, structured_output=schema)
            submit = asyncio.create_task(engine.submit([3, 4], params, request_id="slow"))
            while engine.snapshot().num_waiting_for_grammar != 1:  # counted as waiting meanwhile
                await asyncio.sleep(0.02)
            await engine.abort("slow")
            try:
                await submit
                raise AssertionError("submit of an aborted request must not return its id")
            except RequestAbortedError as e:
                assert "'slow'" in str(e)
            assert engine.snapshot().num_waiting_for_grammar == 0
            release.set()
            # the grammar (compiled for the next one) never lets the aborted request in
            assert (await run_request(engine, [3, 4], params)).text in ("true", "false")
            snap = engine.snapshot()
            assert not snap.running and not snap.waiting and not engine._live and not engine.scheduler.requests


async def test_an_abort_right_after_submit_refuses_a_schema_request(tiny_model):
    """Its grammar task was cancelled before it first ran, so the code that answers an abort
    never ran either: submit hung for ever (the grammar was cached; the abort came first)."""
    from engine import RequestAbortedError, StructuredOutput

    params = SamplingParams(max_tokens=4, temperature=0.0, structured_output=StructuredOutput.from_schema(
        {"type": "boolean"}))
    async with asyncio.timeout(60), Engine(tiny_config(), loaded=tiny_model) as engine:
        await run_request(engine, [3, 4], params)  # compiles the grammar: cached from now on
        for i in range(3):
            submit = asyncio.create_task(engine.submit([3, 4], params, request_id=f"r{i}"))
            await asyncio.sleep(0)  # the Submit is in intake's inbox, the abort right behind it
            await engine.abort(f"r{i}")
            try:
                async with asyncio.timeout(10):
                    await submit
                raise AssertionError("submit of an aborted request must not return its id")
            except RequestAbortedError as e:
                assert f"'r{i}'" in str(e)
        assert not engine._in_intake and not engine.intake._aborted
        assert (await run_request(engine, [3, 4], params)).text in ("true", "false")


async def test_an_abort_does_not_wait_behind_other_prompts_being_tokenized(tiny_model, monkeypatch):
    """Sent through intake, an abort of a running request waited for every prompt intake was
    tokenizing first (session 21 re-audit: 4.6 s behind six 1 MB prompts), the request
    generating and holding its KV meanwhile. It goes to the scheduler once intake let go."""
    import threading

    from engine import chat_prompt
    from engine.chat_prompt import LONG_PROMPT_CHARS

    release = threading.Event()
    encode_for_real = chat_prompt.encode

    def encode(tokenizer, text, chat):  # on intake's tokenizer thread (a long prompt)
        if text.startswith("SLOW"):
            release.wait(30)
        return encode_for_real(tokenizer, text, chat)

    monkeypatch.setattr(chat_prompt, "encode", encode)
    async with asyncio.timeout(60):
        async with Engine(tiny_config(), loaded=tiny_model) as engine:
            running = await engine.submit([3, 4, 5], greedy(1000))
            outputs = engine.stream(running)
            await anext(outputs)  # generating
            slow = asyncio.create_task(engine.submit("SLOW" + "x" * LONG_PROMPT_CHARS, greedy(1)))
            await asyncio.sleep(0.2)  # intake is tokenizing it
            try:
                await engine.abort(running)
                async with asyncio.timeout(5):  # the slow prompt takes 30 s
                    last = [out async for out in outputs][-1]
                assert last.finish_reason == "abort"
            finally:
                release.set()
            try:
                await slow
            except Exception:  # refused as too long for the tiny model, or accepted: either is fine
                pass


SLOW_EXIT = """
import asyncio, sys, threading, time
from engine import Engine, SamplingParams, StructuredOutput
from engine.structured.compiler import GrammarCache
from tests.engine.util import tiny_config

GrammarCache._compile = lambda self, spec: time.sleep(120)  # a schema that takes minutes

async def main():
    async with Engine(tiny_config(calibrate_step_cost=False)) as engine:
        submit = asyncio.create_task(engine.submit([3], SamplingParams(structured_output=StructuredOutput.from_schema({}))))
        await asyncio.sleep(0.5)
    try:
        await submit
    except Exception as e:
        print(type(e).__name__, e)

asyncio.run(main())
"""


def test_a_process_stopping_mid_compile_exits_without_waiting_for_it():
    """The compile thread was joined at interpreter exit: a server took ~25 s to exit on SIGTERM."""
    import subprocess
    import sys
    import time

    from tests.engine.util import REPO

    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SLOW_EXIT], capture_output=True, text=True, cwd=REPO, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "EngineDeadError engine stopped" in out.stdout
    assert time.monotonic() - start < 60  # start-up and stop take seconds; the compile would take 120
