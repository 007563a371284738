"""Batching policies: each turns the scheduler's queues into the next step's decisions."""

from engine.policies.base import Decision, Idle, Policy
from engine.policies.chunked import ChunkedPolicy
from engine.policies.continuous import ContinuousPolicy
from engine.policies.static import StaticPolicy


def make_policy(name: str, config) -> Policy:
    match name:
        case "static":
            return StaticPolicy(config)
        case "continuous":
            return ContinuousPolicy(config)
        case "chunked":
            return ChunkedPolicy(config)
    raise ValueError(f"unknown policy {name!r}")


__all__ = ["Decision", "Idle", "Policy", "make_policy"]
