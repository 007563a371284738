"""Optional bearer-token check (server.api_key; empty = open).

With a key, every /v1/* route needs `Authorization: Bearer <key>`; /metrics and /health
need it too when `protect_metrics` / `protect_health` are set. The key is compared with
`hmac.compare_digest` (constant time); a missing, malformed or wrong header is a 401 in the
OpenAI error shape.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from frontends.http.errors import ApiError


def protected_paths(protect_metrics: bool, protect_health: bool) -> tuple[str, ...]:
    return (("/metrics",) if protect_metrics else ()) + (("/health",) if protect_health else ())


def api_key_middleware(api_key: str, *, protect_metrics: bool = False, protect_health: bool = False):
    expected = api_key.encode()
    also = protected_paths(protect_metrics, protect_health)

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in also:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # header bytes that are not UTF-8 arrive as surrogate escapes: keep them, never raise
            given = token.strip().encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected) or scheme.lower() != "bearer":
                raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        return await handler(request)

    return check
