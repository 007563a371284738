"""(f) The event loop stays responsive while the real model prefills a 2,000-token prompt
in one step (continuous policy): /health answers well within a second throughout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import EngineConfig
from tests.frontends.conftest import serving

PROMPT_TOKENS = 2000


@pytest.mark.real_model
async def test_health_during_long_prefill(real_model):
    in_step = threading.Event()

    def mark_long_step(plan) -> None:  # runs in the executor thread just before each step
        if any(len(i.token_ids) >= PROMPT_TOKENS for i in plan.items):
            in_step.set()

    config = EngineConfig.load(None, policy="continuous", num_blocks=160)
    async with serving(real_model, config, fault_hook=mark_long_step) as (engine, client):
        text = " ".join(f"item {i}," for i in range(1500))
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
        assert len(ids) == PROMPT_TOKENS
        post = asyncio.create_task(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "stream": True}))
        assert await asyncio.to_thread(in_step.wait, 60)
        step_started = time.perf_counter()
        latencies = []
        while not post.done():  # headers arrive with the first token, i.e. when the step ends
            t = time.perf_counter()
            resp = await client.get("/health")
            latencies.append(time.perf_counter() - t)
            assert resp.status == 200
            await asyncio.sleep(0.1)
        prefill_s = time.perf_counter() - step_started
        resp = await post
        assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
    print(f"\n/health during a {PROMPT_TOKENS}-token prefill ({prefill_s:.1f} s, {len(latencies)} probes): "
          f"max {max(latencies) * 1000:.1f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms")
    assert len(latencies) >= 3
    assert max(latencies) < 1.0
