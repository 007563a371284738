"""Watching the server: /health, /metrics (Prometheus), /v1/engine/state (a JSON snapshot
plus the config) and /v1/engine/steps (every StepRecord, live, as SSE)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from engine import Engine
from frontends.http import sse
from frontends.http.errors import ApiError, unready
from frontends.http.metrics import CONTENT_TYPE
from frontends.http.state import STATE


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    if state.live.closing:
        return _json({"status": "shutting_down"}, 503)
    if engine.dead:
        return _json({"status": "dead", "reason": engine.dead}, 503)
    if not engine.ready:
        return _json({"status": unready(engine)[0]}, 503)
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def state_of(engine: Engine) -> dict:
    """The body of /v1/engine/state (an engine replica serves the same through Ray)."""
    config = engine.config.to_dict()
    if config["server"]["api_key"]:
        config["server"]["api_key"] = "<redacted>"
    return {
        "model": engine.model_name,
        "ready": engine.ready,
        "dead": engine.dead,
        "max_model_len": getattr(engine, "max_model_len", None),
        "snapshot": engine.snapshot() if engine.ready else None,
        "step_cost": engine.step_cost() if engine.ready else None,
        "config": config,
    }


def _no_replica(request: web.Request) -> None:
    """`?replica=` names a replica of a cluster ingress; one engine has none to choose, and
    answering with its own figures would show them under the name asked for."""
    if "replica" in request.query:
        raise ApiError(404, f"no replica {request.query['replica']!r}: this server runs one engine "
                            "(a cluster ingress, engine-serve --replicas N, has replicas)",
                       param="replica", code="unknown_replica")


async def engine_state(request: web.Request) -> web.Response:
    _no_replica(request)
    return _json(state_of(request.app[STATE].engine))


async def engine_steps(request: web.Request) -> web.StreamResponse:
    _no_replica(request)
    state = request.app[STATE]
    if state.engine.dead:  # no step will ever come: an empty 200 stream would read as a flapping connection
        raise ApiError(503, f"the engine is dead: {state.engine.dead}", code="engine_dead")
    with state.live.track(), state.feed.subscribe() as records:
        return await sse.relay(request, records)
