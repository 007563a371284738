"""Start and stop the engine replicas on Ray Serve (blocking calls: run them off the event loop).

Each replica is its own Serve application of one deployment (`replica-0`, `replica-1`, ...)
with `num_replicas=1`, so a handle addresses exactly one engine — the router, not Ray's
power-of-two-choices, decides where a request goes — while Serve still restarts a replica
that dies. Serve's own HTTP proxy is disabled: the ingress is our aiohttp app.
"""

from __future__ import annotations

import math
import os
import socket
import sys
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
            _check_reachable(cluster.ray_address)  # ray.init retries an address where nothing answers for ever
            try:
                ray.init(address=cluster.ray_address, log_to_driver=False)  # as a local Ray: no replica log lines here
            except ValueError as e:  # not an address Ray reads ("foo")
                raise ConnectionError(f"[cluster] ray_address {cluster.ray_address!r}: {e}; give \"auto\", "
                                      "host:port or ray://host:port") from None
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
        _check_resources(config, started_ray)
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
        try:
            handles = dict(zip(names, serve.run_many(targets), strict=True))
        except RuntimeError as e:  # "Deploying application replica-0 failed": the reason is in Serve's status
            raise RuntimeError(f"{e} {_deployment_errors(names)}".strip()) from None  # the engine's own error
        first = handles[names[0]].describe.remote().result()
        return cls(handles, first["max_model_len"], started_ray)

    def stop(self) -> None:
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()
        else:  # a shared cluster: take down only our applications
            for name in self.handles:
                serve.delete(name)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A `host:port` (or `ray://host:port`) where nothing listens is refused at once; so is
    "auto" when the address Ray finds for it (RAY_ADDRESS, else the last cluster started on
    this node, which may be long gone) does not answer, or when it finds none."""
    where = repr(address)
    if address == "auto" and os.environ.get("RAY_ADDRESS"):  # any form ray.init takes (ray://, host:port)
        where, address = f"'auto' ({os.environ['RAY_ADDRESS']}: from RAY_ADDRESS)", os.environ["RAY_ADDRESS"]
    elif address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            resolved = canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError) as e:
            raise ConnectionError(f"--ray-address auto: {e}") from None
        if resolved is None:
            return
        where, address = f"'auto' ({resolved}: the node's last `ray start`)", resolved
    hostport = address.split("://", 1)[-1]
    if ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"could not join the Ray cluster at {where} ([cluster] ray_address): nothing "
                              f"answers there ({e}); is `ray start --head` running on it?") from None


def _check_resources(config: EngineConfig, started_ray: bool) -> None:
    """The replicas' CPUs and GPUs exist: Serve would wait for them for ever, silently."""
    cluster = config.cluster
    have = ray.cluster_resources()
    short = []
    for kind, per_replica, flag in (("CPU", cluster.replica_cpus, "--replica-cpus"),
                                    ("GPU", cluster.replica_gpus, "--replica-gpus")):
        need = cluster.replicas * per_replica
        if need > have.get(kind, 0):
            short.append(f"{cluster.replicas} x {per_replica:g} = {need:g} {kind}s ({flag}), "
                         f"it has {have.get(kind, 0):g}")
    if not short:
        return
    message = f"the {cluster.replicas} replicas need more than the Ray cluster has: {'; '.join(short)}"
    if started_ray:  # our own local Ray: nothing will ever add them
        raise ValueError(f"{message} (a local Ray gets --ray-num-cpus CPUs and the GPUs it sees)")
    print(f"[stepwise] warning: {message}; the replicas start only once an autoscaler adds them", file=sys.stderr)


def _deployment_errors(names: list[str]) -> str:
    """Why the replicas' deployments failed (e.g. the engine's own start-up error), from Serve."""
    try:
        apps = serve.status().applications
    except Exception:  # the reason stays in Ray's logs
        return ""
    # the message ends with the replica's traceback: its last line is the error itself
    messages = [f"{name}: {d.message.strip().splitlines()[-1]}" for name in names if name in apps
                for d in apps[name].deployments.values() if d.message.strip()]
    return "; ".join(messages)
