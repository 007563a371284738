"""(f) The event loop keeps serving while a step runs: the step runs in the executor's thread,
so /health answers while a long prefill step is held there (a fault hook blocks it on an
event; nothing is timed). How fast the loop answers under a real forward is a benchmark's
business, not a unit test's."""

from __future__ import annotations

import asyncio
import threading

from tests.frontends.conftest import serving, tiny_config

PROMPT_TOKENS = 200


async def test_health_answers_while_a_long_prefill_step_runs(tiny_model):
    in_step, release = threading.Event(), threading.Event()

    def hold_long_step(plan) -> None:  # runs in the executor thread just before each step
        if any(len(i.token_ids) >= PROMPT_TOKENS for i in plan.items):
            in_step.set()
            release.wait(60)

    config = tiny_config(policy="continuous", max_num_batched_tokens=PROMPT_TOKENS)
    async with serving(tiny_model, config, fault_hook=hold_long_step) as (engine, client):
        ids = [100 + i % 150 for i in range(PROMPT_TOKENS)]
        post = asyncio.create_task(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "stream": True}))
        try:
            assert await asyncio.to_thread(in_step.wait, 60)
            for _ in range(3):  # the step is still in progress: every answer came from the loop meanwhile
                resp = await client.get("/health")
                assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
        finally:
            release.set()
        resp = await post
        assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
