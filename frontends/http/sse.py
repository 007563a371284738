"""Server-sent events, the way the OpenAI API frames them: `data: <payload>\n\n`.

`frame` is the only place bytes get their framing; `[DONE]` goes through it too.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    response = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
    await response.prepare(request)
    return response
