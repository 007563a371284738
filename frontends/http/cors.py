"""Cross-origin requests from browsers ([server] allowed_origins; empty = none).

A page on another origin (a web chat UI on http://localhost:3000, say) may call the API only if
the server says so. With origins configured:

- a preflight (OPTIONS with Origin and Access-Control-Request-Method) from an allowed origin is
  answered 204 with the methods and headers it asked for, before routing and the API key (a
  browser sends no credentials on a preflight); from any other origin it is a 403 naming it;
- every response to an allowed origin, errors and SSE streams included, carries
  Access-Control-Allow-Origin and exposes X-Request-Id, Retry-After and (a cluster's)
  X-Stepwise-Replica to the page; with a list of origins every answer says Vary: Origin.

"*" allows any origin (vLLM's and llama.cpp's default); the default here is none, because a
server without an API key would otherwise answer any web page its user visits.
"""

from __future__ import annotations

from aiohttp import web

from frontends.http.errors import ApiError

METHODS = "GET, POST, OPTIONS"
EXPOSED = "X-Request-Id, Retry-After, X-Stepwise-Replica"  # the last: a cluster ingress's
MAX_AGE_S = 600


class Cors:
    """`preflight` goes in the middlewares after error_middleware (which renders its 403) and
    before the API key; `add_headers` is an on_response_prepare signal (it reaches streams too)."""

    def __init__(self, origins: frozenset[str]):
        self.any = "*" in origins
        self.origins = origins

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or origin is None or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if not self.allows(origin):
            raise ApiError(403, f"origin {origin!r} is not allowed ([server] allowed_origins)", code="origin_not_allowed")
        headers = {"Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": str(MAX_AGE_S)}
        if asked := request.headers.get("Access-Control-Request-Headers"):
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        if not self.any:  # the answer depends on the Origin: a cache must not give it to another one
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
        origin = request.headers.get("Origin")
        if origin is None or not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self.any else origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED
