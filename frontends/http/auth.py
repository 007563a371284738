"""Optional bearer-token check on /v1/* (server.api_key; empty = open)."""

from __future__ import annotations

import hmac

from aiohttp import web

from frontends.http.errors import ApiError


def api_key_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        return await handler(request)

    return check
