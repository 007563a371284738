"""A stream's status and SSE headers are sent as soon as the request is accepted, before the
first token: here while the first step is held in the executor."""

from __future__ import annotations

import asyncio
import threading

from tests.frontends.conftest import serving, tiny_config


async def test_headers_before_the_first_token(tiny_model):
    release = threading.Event()

    def hold(plan):  # runs in the executor's worker thread
        release.wait(timeout=60)

    async with serving(tiny_model, tiny_config(), fault_hook=hold) as (_, client):
        try:
            resp = await asyncio.wait_for(client.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 3, "stream": True}), timeout=30)
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            # (the held step would keep the first token back for 60 s: the headers came before it)
        finally:
            release.set()
        body = await resp.read()
    assert body.endswith(b"data: [DONE]\n\n")
