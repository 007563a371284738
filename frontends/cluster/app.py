"""The ingress app: the single-process aiohttp app over a `ClusterEngine`, plus what only a
cluster has.

Completions, chat, models and /health are `frontends.http`'s own handlers (same SSE bytes,
errors, auth, drain). Added here: the `x-stepwise-replica` response header, /metrics merged
from the replicas, and `?replica=NAME` on /v1/engine/steps and /v1/engine/state (default: the
first replica; the state lists every replica with its health and in-flight count).
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec
from aiohttp import web

from frontends.cluster.cluster_engine import ClusterEngine
from frontends.cluster.merged_metrics import merge_metrics
from frontends.cluster.step_relay import StepRelay
from frontends.http import sse
from frontends.http.app import create_app
from frontends.http.errors import ApiError
from frontends.http.metrics import CONTENT_TYPE
from frontends.http.state import STATE

REPLICA_HEADER = "x-stepwise-replica"
SCRAPE_TIMEOUT_S = 5.0
STEP_RELAY = web.AppKey("step_relay", StepRelay)


def create_cluster_app(cluster: ClusterEngine, **kwargs) -> web.Application:
    app = create_app(cluster, views={"/metrics": metrics, "/v1/engine/steps": engine_steps,
                                     "/v1/engine/state": engine_state}, **kwargs)
    app[STEP_RELAY] = StepRelay(cluster)
    app.on_response_prepare.append(_name_replica)
    app.on_shutdown.insert(0, _end_step_streams)
    return app


def _cluster(request: web.Request) -> ClusterEngine:
    return request.app[STATE].engine


async def _name_replica(request: web.Request, response: web.StreamResponse) -> None:
    """The replica that serves the response; for a completions prompt list (one engine request
    per prompt, ids `ID-0`, `ID-1`, ...), each prompt's, comma-separated in prompt order."""
    request_id = response.headers.get("X-Request-Id")
    if not request_id:
        return
    cluster = _cluster(request)
    names = [cluster.replica_of(request_id)]
    if names[0] is None:
        names = list(itertools.takewhile(bool, (cluster.replica_of(f"{request_id}-{i}") for i in itertools.count())))
    if names:
        response.headers[REPLICA_HEADER] = ",".join(names)


def _replica(request: web.Request) -> str:
    cluster = _cluster(request)
    name = request.query.get("replica", next(iter(cluster.handles)))
    if name not in cluster.handles:
        raise ApiError(404, f"no replica {name!r}; replicas: {', '.join(cluster.handles)}", param="replica",
                       code="unknown_replica")
    return name


async def metrics(request: web.Request) -> web.Response:
    cluster = _cluster(request)

    async def scrape(name: str) -> bytes | None:
        try:
            return await asyncio.wait_for(cluster.handles[name].metrics_text.remote(), SCRAPE_TIMEOUT_S)
        except Exception:  # a down replica has no metrics this scrape; replica_up says so
            return None

    texts = dict(zip(cluster.handles, await asyncio.gather(*map(scrape, cluster.handles)), strict=True))
    body = merge_metrics({n: t for n, t in texts.items() if t is not None},
                         {n: n in cluster.router.healthy for n in cluster.handles}, cluster.router.load)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def engine_state(request: web.Request) -> web.Response:
    cluster, name = _cluster(request), _replica(request)
    try:
        state = await asyncio.wait_for(cluster.handles[name].state.remote(), SCRAPE_TIMEOUT_S)
    except Exception as e:
        raise ApiError(503, f"replica {name} did not answer: {type(e).__name__}", code="replica_unavailable") from None
    state["replica"] = name
    state["router"] = cluster.router.policy
    state["replicas"] = [{"name": n, "healthy": n in cluster.router.healthy, "in_flight": cluster.router.load[n]}
                         for n in cluster.handles]
    return web.Response(body=msgspec.json.encode(state), content_type="application/json")


async def engine_steps(request: web.Request) -> web.StreamResponse:
    state, name, cluster = request.app[STATE], _replica(request), _cluster(request)
    if name not in cluster.router.healthy:  # dead or hung: its stream would end at once, or never start
        raise ApiError(503, f"replica {name} is down (its health probe fails)", code="replica_unavailable")
    with state.live.track(), request.app[STEP_RELAY].subscribe(name) as records:
        return await sse.relay(request, records, {REPLICA_HEADER: name})


async def _end_step_streams(app: web.Application) -> None:
    app[STEP_RELAY].close()
