"""The aiohttp application: routes, middlewares, and the background work it owns.

    app = create_app(engine)          # the engine may still be loading
    web.run_app(app, handler_cancellation=True)  # or HttpFrontend(...).start(engine)

Handler cancellation must be on (HttpFrontend and aiohttp's test server do it): it is how a
client's disconnect reaches the handler and aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from aiohttp import web

from engine import Engine
from frontends.http import chat, completions, models, observe, tokenize
from frontends.http.auth import api_key_middleware
from frontends.http.cors import Cors
from frontends.http.errors import body_limit_middleware, error_middleware
from frontends.http.feed import StepFeed
from frontends.http.metrics import Metrics
from frontends.http.state import STATE, ServerState
from frontends.http.streams import LiveRequests

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SHUTDOWN_GRACE_S = 5.0  # live handlers get this long to finish after their requests are aborted


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def create_app(
    engine: Engine,
    *,
    new_id: Callable[[str], str] = _new_id,
    clock: Callable[[], int] = lambda: int(time.time()),
    views: Mapping[str, Handler] | None = None,
) -> web.Application:
    """`engine`: an `Engine`, or anything with its request API (the Ray ingress passes a
    `ClusterEngine`). `views` replaces GET handlers by path (the ingress's /metrics and
    /v1/engine/* read the replicas)."""
    server = engine.config.server
    cors = Cors(server.origins()) if server.allowed_origins.strip() else None
    middlewares = [error_middleware] + ([cors.preflight] if cors else []) + [body_limit_middleware(server.max_body_bytes)]
    if server.api_key:
        middlewares.append(api_key_middleware(server.api_key, protect_metrics=server.protect_metrics,
                                              protect_health=server.protect_health))
    app = web.Application(client_max_size=server.max_body_bytes, middlewares=middlewares)
    if cors:
        app.on_response_prepare.append(cors.add_headers)
    metrics = Metrics(engine, engine.config.served_model_name)
    app[STATE] = ServerState(engine, metrics, StepFeed(engine, metrics), LiveRequests(), new_id, clock)
    app.router.add_post("/v1/completions", completions.create_completion)
    app.router.add_post("/v1/chat/completions", chat.create_chat_completion)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/version", tokenize.version)
    app.router.add_get("/v1/models/{model:.+}", models.retrieve_model)  # a name may hold "/"
    gets = {"/v1/models": models.list_models, "/v1/engine/state": observe.engine_state,
            "/v1/engine/steps": observe.engine_steps, "/health": observe.health, "/metrics": observe.metrics}
    unknown = set(views or ()) - set(gets)
    if unknown:
        raise ValueError(f"views may only replace {sorted(gets)}, not {sorted(unknown)}")
    for path, handler in {**gets, **(views or {})}.items():
        app.router.add_get(path, handler)
    app.cleanup_ctx.append(_run_step_feed)
    app.on_shutdown.append(_close_live)
    return app


async def _run_step_feed(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[STATE].feed.run(), name="stepwise-http-step-feed")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close_live(app: web.Application) -> None:
    """Shutdown (after the listening sockets closed): end step streams, abort generations
    so their handlers finish their responses, wait for them."""
    state = app[STATE]
    state.feed.close()
    await state.live.close_all(state.engine, SHUTDOWN_GRACE_S)
