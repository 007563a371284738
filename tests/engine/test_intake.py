"""Intake: what a request becomes before the scheduler sees it."""

from __future__ import annotations

import asyncio

from engine import Engine, SamplingParams
from tests.engine.util import run_request, tiny_config


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
