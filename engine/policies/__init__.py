"""Batching policies: each turns the queues into the next step's decisions. A policy is one
module here that registers its class with @register; the config's choices come from that."""

import importlib
import pkgutil

from engine.policies.base import POLICIES, Decision, Idle, Policy

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")


def make_policy(name: str, config) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    policy = POLICIES[name](config)
    if not config.cache.enable_prefix_caching:
        policy.uses_prefix_cache = False  # a pool without a cache: admissions look nothing up
    return policy


__all__ = ["POLICIES", "Decision", "Idle", "Policy", "make_policy"]
