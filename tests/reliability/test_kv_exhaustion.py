"""(2) KV exhaustion over HTTP (tiny model). A pool at ~10% of what the load needs: every
request still finishes — by preemption (recompute) — with exactly the greedy text of an
unconstrained run. A request that could never fit the pool is refused at once (400,
OpenAI error shape, code context_length_exceeded) while the others carry on unaffected."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from tests.reliability.util import (
    CHAT, COMPLETIONS, assert_no_leaks, is_openai_error, live_server, sse_events, stream_text, tiny_config,
)

BLOCK = 16
NUM_REQUESTS = 16
MAX_TOKENS = 60
# prompts of 40..70 tokens (byte tokenizer: one per character) + 60 generated = 7..9 blocks each
PROMPTS = [f"Request {i:02d} asks: " + "tell me about " * (2 + i % 4) + "the sea." for i in range(NUM_REQUESTS)]


def blocks_needed() -> int:
    return sum(-(-(len(p) + MAX_TOKENS) // BLOCK) for p in PROMPTS)


def body(i: int, stream: bool) -> tuple[str, dict]:
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if i % 4 == 3:
        return CHAT, {"messages": [{"role": "user", "content": PROMPTS[i]}], **common}
    return COMPLETIONS, {"prompt": PROMPTS[i], **common}


async def run_load(url: str) -> list[str]:
    """All requests at once, streamed; returns each one's text (asserting a clean finish)."""
    async with aiohttp.ClientSession(url) as http:

        async def one(i: int) -> str:
            path, data = body(i, stream=True)
            async with http.post(path, json=data) as resp:
                assert resp.status == 200, await resp.text()
                events = sse_events(await resp.read())
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            return stream_text(events[:-1])

        return list(await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))))


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[str]:
    """The unconstrained run: a pool far larger than the load (its own event loop: module scope)."""
    async def run() -> list[str]:
        async with live_server(tiny_model, tiny_config(num_blocks=512)) as (engine, frontend):
            texts = await run_load(frontend.url)
            assert engine.snapshot().num_preemptions == 0
        return texts

    return asyncio.run(run())


@pytest.mark.parametrize("policy", ["chunked", "continuous", "static"])
async def test_pool_at_ten_percent_still_finishes_everything(tiny_model, reference, policy):
    need = blocks_needed()
    pool = max(round(need * 0.1), max(-(-(len(p) + MAX_TOKENS) // BLOCK) for p in PROMPTS))  # ~10%, one always fits
    assert pool <= need * 0.12, (pool, need)
    config = tiny_config(num_blocks=pool, block_size=BLOCK, policy=policy)
    async with live_server(tiny_model, config) as (engine, frontend):
        async with asyncio.timeout(120):
            texts = await run_load(frontend.url)
        assert texts == reference  # same greedy text as with a pool 40x larger
        preemptions = engine.snapshot().num_preemptions
        print(f"\n{policy}: {NUM_REQUESTS} requests needing {need} blocks on a {pool}-block pool: "
              f"{preemptions} preemptions")
        assert preemptions > 0
        await assert_no_leaks(engine, frontend)


async def test_a_request_that_can_never_fit_is_refused_at_once(tiny_model, reference):
    need = blocks_needed()
    pool = max(round(need * 0.1), 9)
    config = tiny_config(num_blocks=pool, block_size=BLOCK)
    capacity = pool * BLOCK
    # Steps run while `steps` is set: the refusals below are answered while it is clear, so they
    # come at once, not after the load drains (no step can finish meanwhile).
    steps = threading.Event()
    steps.set()
    async with live_server(tiny_model, config, fault_hook=lambda plan: steps.wait(60)) as (engine, frontend):
        load = asyncio.create_task(run_load(frontend.url))
        async with aiohttp.ClientSession(frontend.url) as http:
            # wait until the pool is under pressure, then ask for more than it could ever hold
            async with asyncio.timeout(60):
                while engine.snapshot().num_preemptions == 0 and not load.done():
                    await asyncio.sleep(0.005)
            giants = [
                (COMPLETIONS, {"prompt": "x" * (capacity - 10), "max_tokens": 20}),
                (COMPLETIONS, {"prompt": "x" * 10, "max_tokens": capacity, "stream": True}),
                (CHAT, {"messages": [{"role": "user", "content": "y" * capacity}], "max_tokens": 5, "stream": True}),
            ]
            steps.clear()  # from the next step on, the engine makes no progress until the refusals are in
            try:
                for path, data in giants:
                    async with http.post(path, json=data) as resp:
                        status, payload = resp.status, await resp.json()
                    assert status == 400, payload
                    assert is_openai_error(payload) and payload["error"]["code"] == "context_length_exceeded", payload
                    assert "could never run" in payload["error"]["message"] or "context length" in payload["error"]["message"]
            finally:
                steps.set()
            assert not load.done() or load.exception() is None
        assert await asyncio.wait_for(load, 120) == reference  # the others are unaffected
        await assert_no_leaks(engine, frontend)
