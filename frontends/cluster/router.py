"""Router: which engine replica serves a request. The cluster's only routing state.

It lives in the ingress process, not in a replica, so a replica that dies and is restarted by
Ray takes nothing of it along: the router marks it down (its prefixes go: its KV cache is
gone), keeps routing to the others, and marks it up when it answers health checks again.

Policies (`[cluster] router`):
- "prefix": a prompt is known by the hash chain of its full KV blocks — the same BLAKE2b chain
  the block manager keys its prefix cache with (`engine.block_hash`) — and goes to the replica
  that was last sent its longest known prefix, where those blocks most likely still sit in
  the prefix cache, if that prefix is at least `min_share` of the prompt (a chat template's
  opening block, which every conversation shares, would otherwise send every chat to one
  replica; SGLang's cache threshold). With no such prefix, or when that replica is
  overloaded (its in-flight requests exceed the least-loaded replica's by more than
  `abs_threshold` AND by more than `rel_threshold` times, SGLang's rule), it goes to the
  least-loaded replica.
- "least-loaded": fewest in-flight requests.
- "round-robin": the next healthy replica in turn.

Ties between equally loaded replicas go round the replicas in turn, so idle replicas share
distinct prompts. `route` / `release` pair up: every routed request is released once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.config import ROUTERS, ClusterConfig


class Router:
    def __init__(self, names: Sequence[str], policy: str = "prefix", *, abs_threshold: int = 8,
                 rel_threshold: float = 1.5, max_prefix_entries: int = 65536, min_share: float = 0.5):
        if policy not in ROUTERS:
            raise ValueError(f"router {policy!r}: must be one of {ROUTERS}")
        if not names or len(set(names)) != len(names):
            raise ValueError(f"replica names must be distinct and not empty, got {list(names)}")
        self.names = list(names)
        self.policy = policy
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.max_prefix_entries = max_prefix_entries
        self.min_share = min_share
        self.load = dict.fromkeys(self.names, 0)  # in-flight requests routed to each replica
        self.healthy = set(self.names)
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> replica, least recent first
        self._turn = 0  # round-robin cursor, also breaks ties between equally loaded replicas

    @property
    def num_prefix_entries(self) -> int:
        return len(self._owner)

    def owner(self, block_hash: bytes) -> str | None:
        return self._owner.get(block_hash)

    # --- routing ----------------------------------------------------------------------------

    def choose(self, hashes: Sequence[bytes], prompt_blocks: float | None = None,
               exclude: frozenset[str] = frozenset()) -> str | None:
        """The replica for a prompt with this block-hash chain (of its full blocks; `prompt_blocks`:
        its length in blocks, partial one included, default len(hashes)), other than `exclude`
        (replicas that just refused it: their queue is full); None when none is healthy."""
        live = [self.names[(self._turn + i) % len(self.names)] for i in range(len(self.names))]
        live = [n for n in live if n in self.healthy and n not in exclude]
        if not live:
            return None
        least = min(live, key=self.load.__getitem__)  # first of the minima, starting at the cursor
        if self.policy == "round-robin":
            return live[0]
        if self.policy == "least-loaded":
            return least
        known = next((i for i in range(len(hashes) - 1, -1, -1) if hashes[i] in self._owner), None)
        if known is None or known + 1 < self.min_share * (prompt_blocks or len(hashes)):
            return least
        match = self._owner[hashes[known]]
        return least if self._overloaded(match, least) else match

    def _overloaded(self, name: str, least: str) -> bool:
        mine, lowest = self.load[name], self.load[least]
        return mine - lowest > self.abs_threshold and mine > self.rel_threshold * lowest

    @classmethod
    def for_cluster(cls, names: Sequence[str], cluster: ClusterConfig, policy: str | None = None) -> Router:
        """A router with `[cluster]`'s settings (its policy unless `policy` says otherwise): the
        ingress and engine-sim build theirs here, so a setting cannot reach one and not the other."""
        return cls(names, policy or cluster.router, abs_threshold=cluster.balance_abs_threshold,
                   rel_threshold=cluster.balance_rel_threshold, max_prefix_entries=cluster.max_prefix_entries,
                   min_share=cluster.prefix_min_share)

    def route(self, hashes: Sequence[bytes], prompt_blocks: float | None = None,
              exclude: frozenset[str] = frozenset()) -> str | None:
        """Choose, count the request in flight there, and remember its prefix there."""
        name = self.choose(hashes, prompt_blocks, exclude)
        if name is None:
            return None
        self._turn = (self.names.index(name) + 1) % len(self.names)  # next time, start after it
        self.load[name] += 1
        if self.policy == "prefix":
            for h in hashes:
                self._owner[h] = name
                self._owner.move_to_end(h)
            while len(self._owner) > self.max_prefix_entries:
                self._owner.popitem(last=False)
        return name

    def release(self, name: str) -> None:
        """A routed request ended (finished, failed, aborted)."""
        if self.load[name] <= 0:
            raise ValueError(f"release of {name!r} without a routed request")
        self.load[name] -= 1

    # --- health -----------------------------------------------------------------------------

    def mark_down(self, name: str) -> None:
        """No new requests until `mark_up`; its prefixes are forgotten (a restart empties its cache)."""
        self.healthy.discard(name)
        for h in [h for h, owner in self._owner.items() if owner == name]:
            del self._owner[h]

    def mark_up(self, name: str) -> None:
        if name not in self.load:
            raise ValueError(f"unknown replica {name!r}")
        self.healthy.add(name)

    def check_invariants(self) -> None:
        assert set(self.load) == set(self.names), "load is kept for exactly the replicas"
        assert all(n >= 0 for n in self.load.values()), f"negative load: {self.load}"
        assert self.healthy <= set(self.names), f"unknown healthy replicas: {self.healthy - set(self.names)}"
        assert len(self._owner) <= self.max_prefix_entries, "prefix table over its bound"
        assert all(owner in self.healthy for owner in self._owner.values()), "a prefix points at a down replica"
        assert self.policy == "prefix" or not self._owner, "only the prefix policy remembers prefixes"
        assert 0 <= self._turn < len(self.names)
