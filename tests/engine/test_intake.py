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
