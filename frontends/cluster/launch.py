"""Start and stop the engine replicas on Ray Serve (blocking calls: run them off the event loop).

Each replica is its own Serve application of one deployment (`replica-0`, `replica-1`, ...)
with `num_replicas=1`, so a handle addresses exactly one engine — the router, not Ray's
power-of-two-choices, decides where a request goes — while Serve still restarts a replica
that dies. Serve's own HTTP proxy is disabled: the ingress is our aiohttp app.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve import RunTarget
from ray.serve.handle import DeploymentHandle

from engine import EngineConfig
from frontends.cluster.replica import EngineReplica


CONTROL_CALLS = 64  # calls a replica takes beside its generations: never queued behind them


def replica_names(n: int) -> list[str]:
    return [f"replica-{i}" for i in range(n)]


def replica_config(config: EngineConfig) -> dict:
    """What one replica's Engine gets: the same config, with its thread count fixed."""
    raw = config.to_dict()
    if not config.model.num_threads:
        raw["model"]["num_threads"] = max(1, math.floor(config.cluster.replica_cpus))
    return raw


@dataclass
class Replicas:
    handles: dict[str, DeploymentHandle]  # name -> handle of its one-replica deployment
    max_model_len: int
    started_ray: bool  # we started a local Ray (and stop it again)

    @staticmethod
    def connect(config: EngineConfig) -> bool:
        """Start a local Ray or join `ray_address`; True when we started one. Call it on the
        main thread: Ray ties its local processes' lives to the thread that started them."""
        cluster = config.cluster
        if ray.is_initialized():
            return False
        if cluster.ray_address:
            try:
                ray.init(address=cluster.ray_address)
            except ConnectionError as e:
                raise ConnectionError(
                    f"could not join the Ray cluster at {cluster.ray_address!r}: {e}. A cluster started with "
                    "`ray start --head` uses Ray's token authentication: set RAY_AUTH_MODE=token and make the "
                    "token available (~/.ray/auth_token or RAY_AUTH_TOKEN), or use --ray-address auto on a node "
                    "of the cluster") from e
            return False
        num_cpus = cluster.ray_num_cpus or math.ceil(cluster.replicas * cluster.replica_cpus)
        # address="local": a new Ray of our own, even where `ray start` ran before (a cluster's
        # address file left in /tmp/ray would otherwise make ray.init join, or fail to join, it)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        return True

    @classmethod
    def start(cls, config: EngineConfig, started_ray: bool) -> Replicas:
        """Deploy the replicas and wait until each has loaded its engine (blocking)."""
        cluster = config.cluster
        serve.start(proxy_location="Disabled")
        scheduler = config.scheduler
        deployment = serve.deployment(EngineReplica).options(
            num_replicas=1,
            # Ray's default (5) would starve batching: admit what the engine itself admits, so that
            # the engine refuses the rest at once (503 queue_full) rather than Ray queueing them
            # unseen, and room beside them for health checks, metrics, state, aborts and step streams.
            max_ongoing_requests=scheduler.max_num_seqs + scheduler.max_waiting + CONTROL_CALLS,
            max_queued_requests=-1,
            ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
        )
        engine_config = replica_config(config)
        names = replica_names(cluster.replicas)
        targets = [RunTarget(deployment.options(name=name).bind(engine_config, name), name=name, route_prefix=None)
                   for name in names]
        handles = dict(zip(names, serve.run_many(targets), strict=True))
        first = handles[names[0]].describe.remote().result()
        return cls(handles, first["max_model_len"], started_ray)

    def stop(self) -> None:
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()
        else:  # a shared cluster: take down only our applications
            for name in self.handles:
                serve.delete(name)
