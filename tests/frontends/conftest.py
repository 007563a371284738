"""Helpers for the HTTP frontend tests: an engine + aiohttp test client on the tiny model
(or the real one), SSE parsing, and Prometheus metric look-ups."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig
from frontends.http import HttpFrontend, create_app, sse
from tests import tiny

# A small budget and chunk, so that a stream takes several steps.
tiny_config = functools.partial(tiny.tiny_config, max_num_batched_tokens=64, chunk_size=32)


@asynccontextmanager
async def serving(loaded, config: EngineConfig, *, fault_hook=None, **app_kwargs) -> AsyncIterator[tuple[Engine, TestClient]]:
    """A started engine and a test client on its app (aiohttp's test server runs with
    handler cancellation, as HttpFrontend does). The client closes before the engine stops."""
    engine = Engine(config, loaded=loaded, fault_hook=fault_hook)
    await engine.start()
    client = TestClient(TestServer(create_app(engine, **app_kwargs)))
    await client.start_server()
    try:
        yield engine, client
    finally:
        await client.close()
        await engine.stop()


@asynccontextmanager
async def openai_serving(loaded, config: EngineConfig, *, api_key: str = "none",
                         timeout: float = 300) -> AsyncIterator[tuple[Engine, openai.AsyncOpenAI]]:
    """A started engine behind a real HttpFrontend (HTTP first, as engine-serve does) and an
    `openai` client on it. The client closes first, then the frontend, then the engine."""
    engine = Engine(config, loaded=loaded)
    frontend = HttpFrontend("127.0.0.1", 0)
    await frontend.start(engine)
    await engine.start()
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    try:
        yield engine, client
    finally:
        await client.close()
        await frontend.stop()
        await engine.stop()


@pytest.fixture
async def tiny(tiny_model) -> AsyncIterator[tuple[Engine, TestClient]]:
    async with serving(tiny_model, tiny_config()) as pair:
        yield pair


def sse_events(body: bytes) -> list:
    """An SSE body's payloads (JSON objects, or the string "[DONE]"), every frame exactly as
    sse.frame writes it."""
    return [sse.decode(data) for data in sse.parse_body(body, strict=True)]


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (summed over unlisted labels)."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    assert found, f"no sample {name}{labels}"
    return total


async def get_metric(client: TestClient, name: str, **labels) -> float:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return metric(await resp.text(), name, **labels)
