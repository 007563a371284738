"""Optional bearer-token check (server.api_key; empty = open).

With a key, every route needs `Authorization: Bearer <key>` but /health, /metrics and
/version, which need it too when `protect_health` / `protect_metrics` are set (/version never:
it is the server's version alone). /tokenize and /detokenize are not under /v1 (as vLLM's) but
need it: a chat with many tools costs seconds to render. The key is compared with
`hmac.compare_digest` (constant time); a missing, malformed or wrong header is a 401 in the
OpenAI error shape.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from frontends.http.errors import ApiError


def public_paths(protect_metrics: bool, protect_health: bool) -> frozenset[str]:
    """The routes a request reaches without the key."""
    return frozenset({"/version"} | (set() if protect_metrics else {"/metrics"})
                     | (set() if protect_health else {"/health"}))


def api_key_middleware(api_key: str, *, protect_metrics: bool = False, protect_health: bool = False):
    expected = api_key.encode()
    public = public_paths(protect_metrics, protect_health)

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in public:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # header bytes that are not UTF-8 arrive as surrogate escapes: keep them, never raise
            given = token.strip().encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected) or scheme.lower() != "bearer":
                raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        return await handler(request)

    return check
