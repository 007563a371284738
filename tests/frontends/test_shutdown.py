"""HttpFrontend.stop with generations in flight: every one gets an answer (503 shutting_down),
promptly, whatever stage it is at — a batch of prompts, a request waiting for its grammar.
(The whole process on SIGTERM: tests/reliability/test_shutdown.py.)"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from engine import Engine, StructuredOutput
from frontends.http import HttpFrontend
from frontends.http.app import SHUTDOWN_GRACE_S
from tests.frontends.conftest import tiny_config

LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


async def stop_during(tiny_model, body: dict, ready) -> tuple[int, dict, float]:
    """POST `body`, stop the frontend once `ready(engine)` holds; the response and how long
    stop took."""
    engine = Engine(tiny_config(shutdown_grace_ms=0, num_blocks=512), loaded=tiny_model)
    frontend = HttpFrontend("127.0.0.1", 0)
    await frontend.start(engine)
    await engine.start()
    try:
        async with aiohttp.ClientSession(frontend.url) as http:
            async def post() -> tuple[int, dict]:
                async with http.post("/v1/completions", json=body) as resp:
                    return resp.status, await resp.json()

            answer = asyncio.create_task(post())
            while not ready(engine):
                assert not answer.done(), await answer
                await asyncio.sleep(0.02)
            start = time.monotonic()
            await frontend.stop()
            took = time.monotonic() - start
            status, payload = await answer
    finally:
        await frontend.stop()
        await engine.stop()
    return status, payload, took


async def test_a_batch_of_prompts_in_flight_gets_503_shutting_down(tiny_model):
    """Only the batch's response id was tracked, not its engine requests (`<id>-0`, `<id>-1`):
    shutdown aborted nothing, waited out its grace and dropped the connection unanswered."""
    async with asyncio.timeout(120):  # starts two engines
        status, payload, took = await stop_during(
            tiny_model, {"prompt": ["one", "two"], **LONG}, lambda engine: len(engine.snapshot().running) == 2)
    assert status == 503 and payload["error"]["code"] == "shutting_down", payload
    assert took < SHUTDOWN_GRACE_S


async def test_a_request_waiting_for_its_grammar_gets_503_shutting_down(tiny_model, monkeypatch):
    """Its abort reached the scheduler before the request did: the handler waited out the grace
    and was cancelled, and the client's connection closed with no response."""
    import threading

    from engine.structured.compiler import GrammarCache

    release = threading.Event()
    compile_for_real = GrammarCache._compile
    monkeypatch.setattr(GrammarCache, "_compile", lambda self, spec: release.wait(30) and compile_for_real(self, spec))
    schema = StructuredOutput.from_schema({"type": "boolean"})
    body = {"prompt": "yes or no", "max_tokens": 8, "structured_outputs": {"json": schema.json_schema}}
    try:
        async with asyncio.timeout(120):  # starts two engines
            status, payload, took = await stop_during(
                tiny_model, body, lambda engine: engine.snapshot().num_waiting_for_grammar == 1)
    finally:
        release.set()
    assert status == 503 and payload["error"]["code"] == "shutting_down", payload
    assert took < SHUTDOWN_GRACE_S
