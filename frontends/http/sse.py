"""Server-sent events, the way the OpenAI API frames them: `data: <payload>\n\n`.

Writing: `frame` is the only place bytes get their framing; `[DONE]` goes through it too.
Reading: `EventParser` is the only place frames are taken apart (the monitor, the remote
benchmark, the soak run and the tests all read through it). This module stays light —
aiohttp.web is imported only to open a stream — because `engine-monitor --url` reads through
it and must start without the server's (or torch's) imports.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_EVENT_BYTES = 8 << 20


def frame(payload: object) -> bytes:
    """One SSE event. `payload`: bytes/str sent as is (e.g. "[DONE]"), anything else as JSON."""
    if isinstance(payload, str):
        payload = payload.encode()
    elif not isinstance(payload, bytes):
        payload = msgspec.json.encode(payload)
    return b"data: " + payload + b"\n\n"


DONE = frame("[DONE]")


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Send the status line and SSE headers now (before the first event)."""
    from aiohttp import web

    response = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
    await response.prepare(request)
    return response


async def relay(request: web.Request, events: AsyncIterator[object], headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Open an SSE response and write each of `events` as a frame until they end or the client leaves."""
    response = await open_stream(request, headers)
    try:
        async for event in events:
            await response.write(frame(event))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away
    return response


class SSEError(ValueError):
    """The stream is not SSE this reader accepts (or an event outgrew the limit)."""


class EventParser:
    """Incremental text/event-stream parser: feed bytes, get the data of complete events.

    Lenient (the default) reads any SSE: comment lines (": ...") are keep-alives, "event:",
    "id:" and "retry:" fields are ignored, CRLF is accepted and several "data:" lines join
    with "\\n". Strict accepts only what `frame` writes — every line `data: <payload>`, one a
    frame — for readers that check our own server's bytes.
    """

    def __init__(self, *, strict: bool = False, max_event_bytes: int = MAX_EVENT_BYTES):
        self._buf = b""
        self._data: list[bytes] = []
        self._strict = strict
        self._max = max_event_bytes

    @property
    def is_between_events(self) -> bool:
        """No partial line or event is held back."""
        return not self._buf and not self._data

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        events = []
        while (cut := self._buf.find(b"\n")) >= 0:
            line, self._buf = self._buf[:cut], self._buf[cut + 1 :]
            if self._strict:
                self._strict_line(line)
            elif line.endswith(b"\r"):
                line = line[:-1]
            if not line:  # blank line: dispatch
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if name == b"data":
                self._data.append(value)
        if len(self._buf) + sum(map(len, self._data)) > self._max:
            raise SSEError(f"an event over {self._max} bytes")
        return events

    def _strict_line(self, line: bytes) -> None:
        if line:
            if not line.startswith(b"data: ") or self._data:
                raise SSEError(f"not a `data: ` frame: {line[:200]!r}")
        elif not self._data:
            raise SSEError("an empty frame")


def parse_body(body: bytes, *, strict: bool = True) -> list[bytes]:
    """The data of every event in a whole SSE body, which must end where an event ends."""
    parser = EventParser(strict=strict)
    events = parser.feed(body)
    if not parser.is_between_events:
        raise SSEError(f"the body ends inside an event: {body[-200:]!r}")
    return events


def decode(data: bytes) -> object:
    """An OpenAI stream event's data: the string "[DONE]", or the JSON object."""
    return "[DONE]" if data == b"[DONE]" else json.loads(data)


async def events(content: aiohttp.StreamReader, parser: EventParser | None = None) -> AsyncIterator[bytes]:
    """The data of each event of a response body as it arrives, until the body ends."""
    parser = parser or EventParser()
    async for chunk in content.iter_any():
        for data in parser.feed(chunk):
            yield data
