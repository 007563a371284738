"""Helpers for the reliability tests: a real server (engine + HttpFrontend on 127.0.0.1:0) in
the test's event loop or in a thread of its own, SSE reading, the OpenAI error shape, and
bounded waiting (never bare sleeps)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from engine import Engine, EngineConfig
from frontends.http import HttpFrontend
from frontends.http.state import STATE
from tests.frontends.conftest import sse_events, tiny_config  # noqa: F401  (re-exported for the reliability tests)

REPO = Path(__file__).resolve().parents[2]
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def load_soak():
    """examples/soak.py as a module (examples/ is not a package)."""
    name = "stepwise_soak"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def live_server(loaded, config: EngineConfig, *, fault_hook=None) -> AsyncIterator[tuple[Engine, HttpFrontend]]:
    """A started engine behind a real HttpFrontend on 127.0.0.1 (port from the config; 0 = free)."""
    engine = Engine(config, loaded=loaded, fault_hook=fault_hook)
    await engine.start()
    frontend = HttpFrontend()
    await frontend.start(engine)
    try:
        yield engine, frontend
    finally:
        await frontend.stop()
        await engine.stop()


class ThreadedServer:
    """A live server running its own event loop in a thread, so synchronous code (hypothesis
    tests, raw sockets) can hit it. `call(coro_fn)` runs a coroutine function on its loop."""

    def __init__(self, loaded, config: EngineConfig, fault_hook=None):
        self.loaded, self.config, self.fault_hook = loaded, config, fault_hook
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reliability-server", daemon=True)
        self.engine: Engine | None = None
        self.frontend: HttpFrontend | None = None

    def call(self, fn: Callable[[], Awaitable[Any]], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()

        async def start() -> None:
            self.engine = Engine(self.config, loaded=self.loaded, fault_hook=self.fault_hook)
            await self.engine.start()
            self.frontend = HttpFrontend()
            await self.frontend.start(self.engine)

        self.call(start)
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            await self.frontend.stop()
            await self.engine.stop()

        try:
            self.call(stop)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()

    @property
    def host(self) -> str:
        return self.frontend.host

    @property
    def port(self) -> int:
        return self.frontend.port

    @property
    def url(self) -> str:
        return self.frontend.url


def live_registry(frontend: HttpFrontend):
    return frontend.runner.app[STATE].live


def stream_text(events: list) -> str:
    text = ""
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            text += c.get("text") or c.get("delta", {}).get("content") or ""
    return text


def is_openai_error(data: Any) -> bool:
    return (isinstance(data, dict) and set(data) == {"error"} and isinstance(data["error"], dict)
            and set(data["error"]) == {"message", "type", "param", "code"}
            and isinstance(data["error"]["message"], str) and data["error"]["message"] != ""
            and isinstance(data["error"]["type"], str)
            and (data["error"]["param"] is None or isinstance(data["error"]["param"], str))
            and (data["error"]["code"] is None or isinstance(data["error"]["code"], str)))


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.005) -> float:
    """Poll `predicate` (bounded by `timeout`); returns the seconds it took."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(poll)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None
    return time.perf_counter() - start


async def assert_no_leaks(engine: Engine, frontend: HttpFrontend, timeout: float = 10) -> None:
    """Nothing left anywhere: queues, live streams, KV blocks, handler registry."""
    def idle() -> bool:
        snap = engine.snapshot()
        return (not snap.running and not snap.waiting and snap.kv_usage == 0 and not engine.scheduler.requests
                and not engine._live and not engine.block_manager.inbox.qsize() and not engine.scheduler.inbox.qsize()
                and len(live_registry(frontend)) == 0)

    try:
        await wait_for(idle, timeout, "the engine to drain")
    except AssertionError:
        snap = engine.snapshot()
        raise AssertionError(f"leak: running={len(snap.running)} waiting={len(snap.waiting)} kv={snap.kv_usage} "
                             f"scheduler.requests={len(engine.scheduler.requests)} engine._live={len(engine._live)} "
                             f"handlers={len(live_registry(frontend))}") from None
    engine.block_manager.check_invariants()
    figures = engine.block_manager.figures
    assert figures.usage == 0 and figures.num_owners == 0 and figures.num_free_blocks == figures.num_blocks

