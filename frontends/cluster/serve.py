"""`engine-serve --replicas N`: engine replicas on Ray Serve behind one OpenAI endpoint.

Start-up: Ray (a local one with `ray.init(num_cpus=...)`, or the cluster at `--ray-address`),
then the replicas (each loads the model), then the tokenizer here, then HTTP on [server]
host/port. SIGINT / SIGTERM drain exactly as `engine-serve` does (the same HttpFrontend):
new requests 503, in-flight ones get `shutdown_grace_ms`, the rest end with an error event
and [DONE]; then the replicas are taken down (and the local Ray stopped). Exit 0. A signal
during start-up stops a local Ray (and the replicas loading on it) at once; a second signal
stops a local Ray before the forced exit.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import NoReturn

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


async def serve_cluster(config: EngineConfig, stop_on_signals: Callable[..., asyncio.Event],
                        access_log: bool = False) -> int:
    # Ray installs its own SIGTERM handler in ray.init: connect first, then take the signals back.
    try:
        started_ray = Replicas.connect(config)
    except ConnectionError as e:  # nothing at --ray-address, or Ray refused us
        print(f"[stepwise] {e}", file=sys.stderr)
        return 1
    stop = stop_on_signals(_shut_ray_down if started_ray else None)
    starting = asyncio.create_task(start_cluster(config, started_ray), name="stepwise-cluster-start")
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done() and started_ray:
        _stop_during_start_up()
    if starting.done() and starting.exception() is not None:
        stopping.cancel()
        print(f"[stepwise] failed to start the replicas: {starting.exception()!r}", file=sys.stderr)
        return 1
    replicas, engine = await starting  # a signal during start-up on a shared cluster: stop once it is up
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


def _stop_during_start_up() -> NoReturn:
    """A signal while the replicas load (minutes on a busy machine): the local Ray is ours, so
    it goes now, and the replicas with it. The deploy, blocked on a worker thread, cannot be
    interrupted and would start a fresh Ray for its next call (Ray's auto-init), so the
    process ends here, once Ray is down."""
    print("[stepwise] stopping the local Ray and the replicas it was starting", file=sys.stderr)
    _shut_ray_down()
    print("[stepwise] stopped", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)


def _shut_ray_down() -> None:
    """Stop the local Ray we started, all its processes (its agents outlived a forced exit),
    and keep a thread still calling Ray from starting a new one (Ray's auto-init)."""
    import ray
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False
    ray.shutdown()
