"""follow() and HttpSource against a fake server speaking the contract."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest
from aiohttp import web

from frontends.http import sse
from monitor.app import MonitorApp
from monitor.http_source import STATE_PATH, STEPS_PATH, HttpSource
from monitor.scripted import ScriptedSource
from monitor.source import Backoff, Connected, Connecting, Disconnected, StateEvent, StepEvent, follow
from monitor.widgets import StatusBar, StepPanel
from tests.monitor.helpers import MIXED_ITEMS, decodes, plain, record, state, until


async def next_of(events, *types, timeout_s: float = 10.0):
    """The next event of one of `types` (others are skipped)."""
    async with asyncio.timeout(timeout_s):
        async for ev in events:
            if isinstance(ev, types):
                return ev
    raise AssertionError("event stream ended")


# --- follow() ----------------------------------------------------------------------------


async def test_follow_yields_connection_steps_state_and_reconnects():
    source = ScriptedSource([decodes(1), decodes(2)], state(2))
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.0))
    async with contextlib.aclosing(events):
        assert isinstance(await next_of(events, Connecting, Connected), Connecting)
        assert isinstance(await next_of(events, Connected), Connected)
        got = []
        while len(got) < 2:
            ev = await next_of(events, StepEvent, StateEvent)
            if isinstance(ev, StepEvent):
                got.append(ev.record.step)
        assert got == [1, 2]
        source.fail()
        ev = await next_of(events, Disconnected)
        assert ev.reason == "scripted connection reset" and ev.attempt == 1
        source.push(decodes(3))
        source.resume()
        await next_of(events, Connected)
        assert (await next_of(events, StepEvent)).record.step == 3


def test_backoff_grows_caps_and_resets():
    b = Backoff(0.5, 3.0)
    assert [b.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next_delay() == 0.5
    zero = Backoff(0.0)
    assert [zero.next_delay() for _ in range(3)] == [0.0, 0.0, 0.0]


# --- HttpSource against a fake engine-serve ---------------------------------------------


class FakeServer:
    """The server side of the contract: SSE of msgspec-encoded StepRecords, JSON state."""

    def __init__(self, port: int, *, state_status: int = 200, raw_frames: list[bytes] = ()):
        self.port = port
        self.records: asyncio.Queue = asyncio.Queue()
        self.state = state(1, [("r0", 20, 20, 2, 16)])
        self.state_status = state_status
        self.raw_frames = list(raw_frames)
        self.runner: web.AppRunner | None = None

    async def steps(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b": connected\n\n")
        for raw in self.raw_frames:
            await resp.write(raw)
        while (rec := await self.records.get()) is not None:
            frame = b"data: " + msgspec.json.encode(rec) + b"\n\n"
            await resp.write(frame[:20])  # a frame split across two TCP writes
            await resp.write(frame[20:])
        return resp

    async def get_state(self, request: web.Request) -> web.Response:
        if self.state_status == 0:  # hangs: a server that stopped answering
            await asyncio.Event().wait()
        if self.state_status != 200:
            return web.Response(status=self.state_status)
        body = msgspec.json.encode({"snapshot": self.state.snapshot, "config": self.state.config})
        return web.Response(body=body, content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(STEPS_PATH, self.steps)
        app.router.add_get(STATE_PATH, self.get_state)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self.records.put_nowait(None)
        await self.runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def server():
    srv = FakeServer(free_port())
    await srv.start()
    yield srv
    await srv.stop()


async def test_http_source_reads_steps_and_state(server):
    source = HttpSource(f"http://127.0.0.1:{server.port}/")
    mixed = record(5, MIXED_ITEMS, ttft=(0.4,), itl=(0.1, 0.2))
    server.records.put_nowait(mixed)
    server.records.put_nowait(decodes(6))
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.05))
    try:
        async with contextlib.aclosing(events):
            await next_of(events, Connected)
            steps, states = [], []
            while len(steps) < 2 or not states:
                ev = await next_of(events, StepEvent, StateEvent)
                (steps if isinstance(ev, StepEvent) else states).append(ev)
            assert steps[0].record == mixed  # every field survives the JSON round trip
            assert steps[1].record.step == 6
            assert states[0].state == server.state
    finally:
        await source.close()


async def test_http_source_turns_the_server_s_control_characters_into_question_marks(server):
    """Escape sequences in ids, the model name or an error reached the terminal as they were:
    a window title, a clear screen, a link planted under a request id."""
    evil = "r\x1b]0;PWNED\x07\x1b[2J\x9b1m\x7f"
    source = HttpSource(f"http://127.0.0.1:{server.port}/")
    server.state = state(1, [(evil, 20, 20, 2, 16)])
    server.state.config["model"]["model"] = evil
    server.records.put_nowait(record(5, [(evil, "decode", 1, 7)]))
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.05))
    try:
        async with contextlib.aclosing(events):
            step = (await next_of(events, StepEvent)).record
            st = (await next_of(events, StateEvent)).state
            seen = [step.items[0].request_id, st.snapshot.running[0].request_id, st.config["model"]["model"]]
            assert seen == ["r?]0;PWNED??[2J?1m?"] * 3
    finally:
        await source.close()


def test_printable_keeps_newlines_tabs_and_escaped_backslashes():
    from monitor.http_source import printable

    assert msgspec.json.decode(printable(rb'"a\nb\tc\\u001b\\\u001b\u00e9"')) == "a\nb\tc\\u001b\\?é"


async def test_http_source_server_down_then_up_then_gone(server):
    port = server.port
    await server.stop()  # nothing listens: "not up yet"
    source = HttpSource(f"http://127.0.0.1:{port}")
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.02, 0.1))
    try:
        async with contextlib.aclosing(events):
            ev = await next_of(events, Disconnected, Connected)
            assert isinstance(ev, Disconnected)
            assert ev.reason == (f"cannot connect to http://127.0.0.1:{port} "
                                 "(connection refused: is engine-serve running?)")
            assert (await next_of(events, Disconnected)).attempt == 2  # keeps retrying

            up = FakeServer(port)
            await up.start()
            up.records.put_nowait(decodes(1))
            await next_of(events, Connected)
            assert (await next_of(events, StepEvent)).record.step == 1

            await up.stop()  # the server goes away mid-stream
            ev = await next_of(events, Disconnected)
            assert ev.reason  # a reason for a person, no traceback
    finally:
        await source.close()


async def test_http_source_state_404_keeps_the_stream(server):
    server.state_status = 404
    server.records.put_nowait(decodes(1))
    source = HttpSource(f"http://127.0.0.1:{server.port}")
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.05))
    try:
        async with contextlib.aclosing(events):
            await next_of(events, Connected)
            assert (await next_of(events, StepEvent, StateEvent, Disconnected)).record.step == 1
            server.records.put_nowait(decodes(2))
            assert (await next_of(events, StepEvent, StateEvent, Disconnected)).record.step == 2
    finally:
        await source.close()


async def disconnect_reason(raw_frames: list[bytes]) -> str:
    """Why HttpSource drops a server that sends these frames first."""
    srv = FakeServer(free_port(), raw_frames=raw_frames)
    await srv.start()
    source = HttpSource(f"http://127.0.0.1:{srv.port}")
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.05))
    try:
        async with contextlib.aclosing(events):
            return (await next_of(events, Disconnected)).reason
    finally:
        await source.close()
        await srv.stop()


async def test_http_source_wrong_contract_is_a_clear_disconnect():
    reason = await disconnect_reason([b'data: {"type": "step", "n": 1}\n\n'])
    assert "server sent a step this monitor cannot read" in reason


async def test_http_source_endless_event_is_a_clear_disconnect():
    reason = await disconnect_reason([b"data: " + b"x" * (sse.MAX_EVENT_BYTES + 1)])
    assert f"an event over {sse.MAX_EVENT_BYTES} bytes" in reason


async def test_http_source_404_on_steps_says_so():
    app = web.Application()
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        for url, hint in ((f"http://127.0.0.1:{port}", "is this a Stepwise server?"),
                          (f"http://127.0.0.1:{port}/v1", "--url is the server's root: drop the /v1")):
            source = HttpSource(url)
            events = follow(source, backoff=Backoff(0.05))
            async with contextlib.aclosing(events):
                ev = await next_of(events, Disconnected)
            await source.close()
            assert "HTTP 404" in ev.reason and hint in ev.reason
    finally:
        await runner.cleanup()


async def test_a_server_that_takes_the_connection_but_never_answers_is_a_disconnect():
    """A stopped (SIGSTOP) server's kernel still accepts connections: without a limit on the
    answer, reconnecting waited for ever at "retrying (attempt 1)"."""
    held: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _, w: held.append(w), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    source = HttpSource(f"http://127.0.0.1:{port}", state_timeout_s=0.2)
    events = follow(source, backoff=Backoff(0.01))
    try:
        async with contextlib.aclosing(events):
            ev = await next_of(events, Disconnected, timeout_s=5)
            assert "sent no answer within 0.2 s" in ev.reason
            assert (await next_of(events, Disconnected, timeout_s=5)).attempt == 2  # and it keeps trying
    finally:
        await source.close()
        for w in held:
            w.close()
        silent.close()


async def test_app_shows_an_unknown_replica_as_refused_without_retrying():
    async def steps(request: web.Request) -> web.Response:
        hits.append(request.query.get("replica"))
        error = {"message": "no replica 'r9'; replicas: replica-0, replica-1", "type": "not_found_error",
                 "param": "replica", "code": "unknown_replica"}
        return web.json_response({"error": error}, status=404)

    hits: list[str | None] = []
    app = web.Application()
    app.router.add_get(STEPS_PATH, steps)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    monitor = MonitorApp(HttpSource(f"http://127.0.0.1:{port}", replica="r9"), backoff=Backoff(0.01),
                         min_refresh_interval_s=0)
    try:
        async with monitor.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: monitor.monitor.status.kind == "refused")
            await asyncio.sleep(0.2)  # a retry would come within 0.01 s
            await pilot.pause()
            status = plain(monitor.query_one(StatusBar))
            assert "refused — not retrying" in status and "replicas: replica-0, replica-1 (--replica)" in status
            assert hits == ["r9"]
    finally:
        await runner.cleanup()


async def test_app_over_http_shows_disconnected_then_recovers():
    port = free_port()
    source = HttpSource(f"http://127.0.0.1:{port}")
    app = MonitorApp(source, state_interval_s=0.05, backoff=Backoff(0.02, 0.1), min_refresh_interval_s=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.monitor.status.kind == "disconnected")
        await pilot.pause()
        status = plain(app.query_one(StatusBar))
        assert "disconnected — retrying" in status and "cannot connect" in status

        srv = FakeServer(port)
        await srv.start()
        try:
            srv.records.put_nowait(record(3, MIXED_ITEMS))
            await until(pilot, lambda: app.steps_shown == 1 and app.monitor.snapshot is not None)
            await pilot.pause()
            assert "● live" in plain(app.query_one(StatusBar))
            assert "pos 384–575" in plain(app.query_one(StepPanel))
        finally:
            await srv.stop()


def test_state_body_while_the_engine_loads_decodes():
    from monitor.source import EngineState

    body = b'{"model": "tiny", "ready": false, "dead": null, "max_model_len": null, "snapshot": null, "config": {}}'
    st = msgspec.json.decode(body, type=EngineState)
    assert st.snapshot is None and not st.ready and st.model == "tiny"


async def test_http_source_state_that_stops_answering_disconnects(server):
    server.state_status = 0
    server.records.put_nowait(decodes(1))
    source = HttpSource(f"http://127.0.0.1:{server.port}", state_timeout_s=0.2)
    events = follow(source, state_interval_s=0.01, backoff=Backoff(0.05))
    try:
        async with contextlib.aclosing(events):
            await next_of(events, Connected)
            assert (await next_of(events, StepEvent, Disconnected)).record.step == 1
            ev = await next_of(events, Disconnected)
            assert ev.reason == f"http://127.0.0.1:{server.port} stopped answering {STATE_PATH} (TimeoutError)"
    finally:
        await source.close()
