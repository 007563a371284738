"""HttpFrontend: the aiohttp app on a TCP socket, as a `Frontend`."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from engine import Engine
from frontends.http.app import create_app


class HttpFrontend:
    def __init__(self, host: str | None = None, port: int | None = None, *, access_log: bool = False,
                 app_factory: Callable[[Engine], web.Application] = create_app):
        self.host = host  # None: from the engine's config ([server] host / port)
        self.port = port
        self.access_log = access_log
        self.app_factory = app_factory
        self.runner: web.AppRunner | None = None

    async def start(self, engine: Engine) -> None:
        server = engine.config.server
        host = self.host or server.host
        port = server.port if self.port is None else self.port
        kwargs = {} if self.access_log else {"access_log": None}
        self.runner = web.AppRunner(self.app_factory(engine), handler_cancellation=True, **kwargs)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()
        self.host, self.port = self.runner.addresses[0][:2]  # the bound port when asked for 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
