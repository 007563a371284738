"""Watch a running `engine-serve` over HTTP.

The contract (frontends/ serves it):

    GET /v1/engine/steps   text/event-stream; one event per step:
                               data: <msgspec JSON of StepRecord>\\n\\n
                           (StepItem and FinishedRequest are array_like Structs, so they
                           travel as JSON arrays), read by frontends.http.sse.EventParser:
                           comment lines (": ...") are keep-alives; "event:", "id:" and
                           "retry:" fields are accepted and ignored.
    GET /v1/engine/state   application/json {"snapshot": <EngineSnapshot> | null,
                           "config": {<section>: {...}}, "model", "ready", "dead",
                           "max_model_len"} (config = EngineConfig.to_dict(); snapshot is
                           null while the engine loads). A 404 or an unreadable body here
                           only hides the queue table; it does not drop the connection.

A cluster ingress (`engine-serve --replicas N`) serves both per replica: `?replica=NAME`
(default: its first), and its state also names the `replica` and lists the `replicas`.

An API key, when the server wants one, goes in `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import msgspec

from engine.messages import StepRecord
from frontends.http import sse
from monitor.source import EngineState, SourceRefused, SourceUnavailable, StepSource

STEPS_PATH = "/v1/engine/steps"
STATE_PATH = "/v1/engine/state"
STATE_FAILURES_TO_DISCONNECT = 3


class HttpSource(StepSource):
    def __init__(self, url: str, *, api_key: str = "", replica: str | None = None, connect_timeout_s: float = 3.0,
                 state_timeout_s: float = 5.0):
        self.url = _checked(url).rstrip("/")
        self.description = self.url
        self.replica = replica
        if replica:
            self.description = f"{self.url} · {replica}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s)
        self._state_timeout = aiohttp.ClientTimeout(total=state_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._decode_record = msgspec.json.Decoder(StepRecord).decode
        self._decode_state = msgspec.json.Decoder(EngineState).decode
        self._state_supported = True
        self._state_failures = 0

    def select_replica(self, name: str) -> None:
        self.replica = name
        self.description = f"{self.url} · {name}"
        if self._response is not None:  # the open stream is the old replica's
            self._response.close()
            self._response = None

    @property
    def _query(self) -> dict[str, str]:
        return {"replica": self.replica} if self.replica else {}

    async def connect(self) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        url = self.url + STEPS_PATH
        try:
            async with asyncio.timeout(self._state_timeout.total):  # the server sends the headers at once
                resp = await self._session.get(url, params=self._query, headers={"Accept": "text/event-stream"})
        except TimeoutError:  # a stopped (SIGSTOP) or wedged server still accepts connections
            raise SourceUnavailable(f"{self.url} took the connection but sent no answer within "
                                    f"{self._state_timeout.total:g} s (stopped or overloaded?)") from None
        except aiohttp.ClientConnectorError as e:
            raise SourceUnavailable(f"cannot connect to {self.url} ({_os_reason(e)})") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise SourceUnavailable(f"cannot connect to {self.url} ({type(e).__name__}: {e})") from None
        if resp.status != 200:
            body = await resp.read()
            resp.release()
            error = _error(body) if resp.status == 404 else None
            if error is not None and error.code == "unknown_replica":
                raise SourceRefused(f"{error.message} (--replica)")
            hint = self._hint(resp.status)
            text = body.decode(errors="replace")[:200].strip()
            raise SourceUnavailable(f"GET {STEPS_PATH} answered HTTP {resp.status}{hint}: {text}")
        self._response = resp
        self._state_supported = True
        self._state_failures = 0

    def _hint(self, status: int) -> str:
        if status in (401, 403):
            return " (wrong --api-key?)"
        if status == 404:
            return " (--url is the server's root: drop the /v1)" if self.url.endswith("/v1") else \
                   " (is this a Stepwise server?)"
        return ""

    async def steps(self) -> AsyncIterator[StepRecord]:
        resp = self._response
        if resp is None:
            raise SourceUnavailable("not connected")
        try:
            async for data in sse.events(resp.content):
                try:
                    yield self._decode_record(printable(data))
                except msgspec.ValidationError as e:
                    raise SourceUnavailable(f"server sent a step this monitor cannot read: {e}") from None
                except msgspec.DecodeError as e:
                    raise SourceUnavailable(f"server sent malformed JSON on {STEPS_PATH}: {e}") from None
        except sse.SSEError as e:
            raise SourceUnavailable(f"server sent {e} on {STEPS_PATH}") from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionError) as e:
            raise SourceUnavailable(f"connection to {self.url} lost ({type(e).__name__})") from None
        # EOF: the server closed the stream (shutting down, restarting)

    async def state(self) -> EngineState | None:
        if not self._state_supported or self._session is None:
            return None
        try:
            async with self._session.get(self.url + STATE_PATH, params=self._query,
                                         timeout=self._state_timeout) as resp:
                if resp.status == 404:
                    self._state_supported = False  # an older server: steps only
                    return None
                if resp.status != 200:
                    return None  # transient (503 while starting, ...): keep the step stream
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            # One slow or failed poll is no reason to drop a live step stream; several in a row
            # mean the server is gone even if the stream has not noticed (a half-open socket).
            self._state_failures += 1
            if self._state_failures >= STATE_FAILURES_TO_DISCONNECT:
                reason = _os_reason(e) if isinstance(e, aiohttp.ClientConnectorError) else type(e).__name__
                raise SourceUnavailable(f"{self.url} stopped answering {STATE_PATH} ({reason})") from None
            return None
        self._state_failures = 0
        try:
            return self._decode_state(printable(body))
        except (msgspec.ValidationError, msgspec.DecodeError):
            self._state_supported = False  # a different contract: don't hammer it
            return None

    async def disconnect(self) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None

    async def close(self) -> None:
        await self.disconnect()
        if self._session is not None:
            await self._session.close()
            self._session = None


def _checked(url: str) -> str:
    """`url` if it can name an HTTP server; a ValueError saying what is wrong otherwise (a
    typo would otherwise be retried for ever as "cannot connect")."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"--url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"--url {url!r}: {e}") from None
    if port == 0:
        raise ValueError(f"--url {url!r}: port 0 is no server's port")
    return url


class _Error(msgspec.Struct):
    message: str = ""
    code: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _Error


# Control characters in a JSON string: \u escapes of C0 (but \n, \t), DEL and C1, after an even
# run of backslashes (an odd one escapes the backslash itself); \b \f \r; DEL and C1 raw in UTF-8.
_CONTROL = re.compile(rb"(?<!\\)((?:\\\\)*)\\(?:u00(?:0[0-8bcdefBCDEF]|1[0-9a-fA-F]|7[fF]|[89][0-9a-fA-F])|[bfr])"
                      rb"|\x7f|\xc2[\x80-\x9f]")


def printable(body: bytes) -> bytes:
    """A server's JSON with every control character in its strings made a "?", newlines and tabs
    kept: a request id, model name or error text is shown in the terminal, where an escape
    sequence would retitle the window, clear the screen or plant a link."""
    return _CONTROL.sub(lambda m: (m.group(1) or b"") + b"?", body)


def _error(body: bytes) -> _Error | None:
    """The OpenAI-shaped error in a response body, if it is one."""
    try:
        return msgspec.json.decode(printable(body), type=_ErrorBody).error
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _os_reason(e: aiohttp.ClientConnectorError) -> str:
    err = e.os_error
    if isinstance(err, ConnectionRefusedError):
        return "connection refused: is engine-serve running?"
    return (err.strerror or str(err)).lower() if err is not None else str(e)
