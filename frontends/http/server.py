"""HttpFrontend: the aiohttp app on a TCP socket, as a `Frontend`.

`stop()` shuts down gracefully: new requests get 503 at once (the socket stays open so they
are told so) while in-flight generations run on for up to [server] shutdown_grace_ms; then
the socket closes, what is still running is aborted (streams end with an error event and
[DONE]) and the handlers are waited for.

Requests too malformed to reach the app (broken HTTP framing, a header line over 8 KiB, too
many headers) are answered by aiohttp's protocol itself; `_OpenAIErrorsHandler` makes those
answers the OpenAI error shape too, so a client always gets {"error": {...}}. Such a request
is logged in one line, not with aiohttp's traceback at ERROR: any client could otherwise write
a dozen lines of log per request.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from engine import Engine
from frontends.http.app import create_app
from frontends.http.errors import ApiError
from frontends.http.state import STATE


class _OpenAIErrorsHandler(RequestHandler):
    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs; raises if a response already started
        else:  # the client's malformed request: one line
            self.logger.warning("malformed HTTP request from %s: %s", request.remote,
                                " ".join(str(message or exc or "").split())[:200])
            if request.writer.output_size > 0:
                raise ConnectionError("Response is sent already, cannot send another response with the error message")
        text = "internal server error" if status >= 500 else f"malformed HTTP request: {(message or '').strip()}"
        response = ApiError(status, text, code="internal_error" if status >= 500 else "bad_http_request").response()
        response.force_close()
        return response


class _OpenAIErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorsServer  # same object, only its protocol factory differs
        return server


class HttpFrontend:
    def __init__(self, host: str | None = None, port: int | None = None, *, access_log: bool = False,
                 app_factory: Callable[[Engine], web.Application] = create_app):
        self.host = host  # None: from the engine's config ([server] host / port)
        self.port = port
        self.access_log = access_log
        self.app_factory = app_factory
        self.runner: web.AppRunner | None = None
        self.grace_s = 0.0

    async def start(self, engine: Engine) -> None:
        server = engine.config.server
        host = self.host or server.host
        port = server.port if self.port is None else self.port
        self.grace_s = server.shutdown_grace_ms / 1000
        kwargs = {} if self.access_log else {"access_log": None}
        self.runner = _Runner(self.app_factory(engine), handler_cancellation=True, **kwargs)
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, host, port).start()
        except OSError as e:  # a host that does not resolve, a port in use
            await self.runner.cleanup()
            self.runner = None
            raise OSError(f"cannot listen on host {host!r}, port {port} ([server] host, port): {e.strerror or e}") from None
        self.host, self.port = self.runner.addresses[0][:2]  # the bound port when asked for 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            live = self.runner.app[STATE].live
            if self.grace_s and live.num_generations:
                print(f"[stepwise] waiting up to {self.grace_s:g} s for {live.num_generations} in-flight "
                      "request(s)", file=sys.stderr)
            await live.drain(self.grace_s)
            await self.runner.cleanup()
            self.runner = None
