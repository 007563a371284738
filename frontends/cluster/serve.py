"""`engine-serve --replicas N`: engine replicas on Ray Serve behind one OpenAI endpoint.

Start-up: Ray (a local one with `ray.init(num_cpus=...)`, or the cluster at `--ray-address`),
then the replicas (each loads the model), then the tokenizer here, then HTTP on [server]
host/port. SIGINT / SIGTERM drain exactly as `engine-serve` does (the same HttpFrontend):
new requests 503, in-flight ones get `shutdown_grace_ms`, the rest end with an error event
and [DONE]; then the replicas are taken down (and the local Ray stopped). Exit 0.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from engine import EngineConfig
from engine.model.loader import load_tokenizer
from frontends.cluster.app import create_cluster_app
from frontends.cluster.cluster_engine import ClusterEngine
from frontends.cluster.launch import Replicas
from frontends.http import HttpFrontend


async def start_cluster(config: EngineConfig, started_ray: bool | None = None) -> tuple[Replicas, ClusterEngine]:
    """Replicas up and a ClusterEngine over them (blocking parts on worker threads).
    `started_ray`: whether the caller already started a local Ray (None: connect here)."""
    cluster = config.cluster
    where = cluster.ray_address or "a local Ray"
    print(f"[stepwise] starting {cluster.replicas} engine replica(s) on {where} (router {cluster.router})...",
          file=sys.stderr)
    if started_ray is None:
        started_ray = Replicas.connect(config)  # on this (the main) thread, blocking: nothing else runs yet
    replicas = await asyncio.to_thread(Replicas.start, config, started_ray)
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model.model, config.model.resolved_cache_dir())
    engine = ClusterEngine(config, replicas.handles, tokenizer, replicas.max_model_len)
    return replicas, await engine.start()


async def serve_cluster(config: EngineConfig, stop_on_signals: Callable[[], asyncio.Event],
                        access_log: bool = False) -> int:
    # Ray installs its own SIGTERM handler in ray.init: connect first, then take the signals back.
    try:
        started_ray = Replicas.connect(config)
    except ConnectionError as e:  # nothing at --ray-address, or Ray refused us
        print(f"[stepwise] {e}", file=sys.stderr)
        return 1
    stop = stop_on_signals()
    starting = asyncio.create_task(start_cluster(config, started_ray), name="stepwise-cluster-start")
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        stopping.cancel()
        print(f"[stepwise] failed to start the replicas: {starting.exception()!r}", file=sys.stderr)
        return 1
    replicas, engine = await starting  # a signal during start-up: stop once it is up
    frontend = HttpFrontend(access_log=access_log, app_factory=create_cluster_app)
    code = 0
    if not stop.is_set():
        try:
            await frontend.start(engine)
        except OSError as e:
            print(f"[stepwise] {e}", file=sys.stderr)
            stop.set()
            code = 1
        else:
            print(f"[stepwise] listening on {frontend.url} ({len(replicas.handles)} replicas of "
                  f"{config.served_model_name}, router {config.cluster.router})", file=sys.stderr)
        await stopping
    await frontend.stop()
    await engine.stop()
    await asyncio.to_thread(replicas.stop)
    print("[stepwise] stopped", file=sys.stderr)
    return code
