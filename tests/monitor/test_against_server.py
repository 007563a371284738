"""HttpSource against the real HTTP frontend (frontends.http) on the tiny model: the SSE and
state contract as the server actually speaks it, API key included."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from engine import Engine
from monitor.http_source import HttpSource
from monitor.source import Backoff, Connected, Disconnected, Refused, StateEvent, StepEvent, follow
from tests.tiny import tiny_config

http = pytest.importorskip("frontends.http")



@contextlib.asynccontextmanager
async def server(tiny_model, **overrides):
    engine = Engine(tiny_config(max_num_batched_tokens=48, chunk_size=16, max_step_ms=0, **overrides), loaded=tiny_model)
    await engine.start()
    srv = TestServer(http.create_app(engine), host="127.0.0.1")
    await srv.start_server()
    try:
        yield engine, f"http://127.0.0.1:{srv.port}"
    finally:
        await srv.close()
        await engine.stop()


async def test_steps_and_state_from_the_real_server(tiny_model):
    async with server(tiny_model, policy="chunked") as (engine, url):
        source = HttpSource(url)
        events = follow(source, state_interval_s=0.05, backoff=Backoff(0.05))
        mixed, states = None, []
        async with contextlib.aclosing(events):
            async with asyncio.timeout(60):
                async for ev in events:
                    if isinstance(ev, Connected):
                        # one request decoding for long, one long prompt chunked next to it
                        long_run = engine.generate("decode me", _params(max_tokens=200))
                        chunked = engine.generate("p" * 300, _params(max_tokens=1))
                        tasks = [asyncio.create_task(_drain(long_run)), asyncio.create_task(_drain(chunked))]
                    elif isinstance(ev, Disconnected):
                        pytest.fail(f"disconnected: {ev.reason}")
                    elif isinstance(ev, StateEvent):
                        states.append(ev.state)
                    elif isinstance(ev, StepEvent) and {i.kind for i in ev.record.items} == {"prefill", "decode"}:
                        mixed = ev.record
                    if mixed is not None and any(s.snapshot and s.snapshot.running for s in states):
                        break
        for t in tasks:
            t.cancel()
        await source.close()
    assert mixed.policy == "chunked" and mixed.token_budget == 48
    assert all(i.num_tokens <= 16 for i in mixed.items if i.kind == "prefill")
    state = next(s for s in states if s.snapshot and s.snapshot.running)
    assert state.ready and state.config["scheduler"]["chunk_size"] == 16
    assert state.config["model"]["model"] == "tiny-random"


async def test_api_key(tiny_model):
    async with server(tiny_model, api_key="sesame") as (_, url):
        for key, expect in (("", Disconnected), ("wrong", Disconnected), ("sesame", Connected)):
            source = HttpSource(url, api_key=key)
            events = follow(source, backoff=Backoff(0.05))
            async with contextlib.aclosing(events):
                async with asyncio.timeout(10):
                    ev = await anext(_aiter_types(events, Connected, Disconnected))
            await source.close()
            assert isinstance(ev, expect), (key, ev)
            if expect is Disconnected:
                assert "HTTP 401" in ev.reason and "--api-key" in ev.reason


async def test_a_replica_of_one_engine_is_refused_for_good(tiny_model):
    """`--replica` against a server without replicas: a 404 naming the parameter (its own
    figures under another name would mislead), and the monitor stops retrying."""
    async with server(tiny_model) as (_, url):
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/engine/steps", "/v1/engine/state"):
                async with session.get(url + path, params={"replica": "replica-1"}) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 404 and error["code"] == "unknown_replica" and error["param"] == "replica"
                    assert "one engine" in error["message"]
        source = HttpSource(url, replica="replica-1")
        events = [ev async for ev in follow(source, backoff=Backoff(0.05))]  # ends by itself
        await source.close()
    assert isinstance(events[-1], Refused) and not any(isinstance(ev, Disconnected) for ev in events)
    assert "no replica 'replica-1'" in events[-1].reason and "--replica" in events[-1].reason


async def test_a_dead_engine_is_a_disconnect_that_says_so_and_keeps_the_history(tiny_model):
    """Once steps() ended with the engine, /v1/engine/steps answered an empty 200 stream: the
    monitor flapped Connected / "stream ended" every 0.5 s, never saw the state saying the
    engine was dead, and each reconnection wiped its history."""
    from monitor.state import MonitorState

    def always(plan):
        raise RuntimeError("executor on fire")

    engine = Engine(tiny_config(max_num_batched_tokens=48, chunk_size=16, max_step_ms=0), loaded=tiny_model,
                    fault_hook=always)
    await engine.start()
    srv = TestServer(http.create_app(engine), host="127.0.0.1")
    await srv.start_server()
    source, monitor, tasks = HttpSource(f"http://127.0.0.1:{srv.port}"), MonitorState(), []
    try:
        events = follow(source, state_interval_s=0.05, backoff=Backoff(0.05))
        async with contextlib.aclosing(events), asyncio.timeout(30):
            async for ev in events:
                if isinstance(ev, StepEvent):
                    monitor.add(ev.record)
                elif not isinstance(ev, StateEvent):
                    monitor.on_connection(ev)
                if isinstance(ev, Connected) and not tasks:
                    tasks.append(asyncio.create_task(_until_dead(engine)))  # three failed steps in a row kill it
                if isinstance(ev, Disconnected) and "the engine is dead" in ev.reason:
                    break
        assert "executor failed 3 steps in a row" in ev.reason and monitor.num_steps_seen >= 3
        assert monitor.last is not None and monitor.last.error  # the failed steps are still on screen
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
        await source.close()
        await srv.close()
        await engine.stop()


async def _until_dead(engine) -> None:
    from engine import EngineDeadError

    with contextlib.suppress(EngineDeadError):
        while True:
            await _drain(engine.generate([5, 6, 7], _params(max_tokens=4)))


def _params(**kw):
    from engine import SamplingParams

    return SamplingParams(ignore_eos=True, temperature=0.0, **kw)


async def _drain(outputs):
    async for _ in outputs:
        pass


async def _aiter_types(events, *types):
    async for ev in events:
        if isinstance(ev, types):
            yield ev
