"""Router, the cluster's routing state: unit tests per policy, plus a hypothesis state machine
that runs it next to a plain reference model (a list of (hash, replica) in recency order) and
checks every choice and the invariants after every operation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.block_hash import prefix_block_hashes
from frontends.cluster.router import Router

NAMES = ["r0", "r1", "r2"]


def chain(*tokens: int, block_size: int = 4) -> list[bytes]:
    return list(prefix_block_hashes(list(tokens), block_size))


SYSTEM = tuple(range(100, 116))  # four full blocks shared by a group of prompts


def test_shared_prefix_sticks_and_distinct_prompts_spread():
    router = Router(NAMES)
    first = router.route(chain(*SYSTEM, 1, 2, 3, 4))
    # every later prompt with the same leading blocks goes where the first went, whatever its tail
    for tail in range(5):
        assert router.route(chain(*SYSTEM, 50 + tail, 7, 7, 7, 9)) == first
    # distinct prompts with no known prefix go to the least-loaded replicas
    others = {router.route(chain(200 + i, 1, 1, 1)) for i in range(2)}
    assert others == set(NAMES) - {first}
    router.check_invariants()


def test_a_prefix_too_small_a_share_of_the_prompt_is_not_followed():
    """Every chat shares its template's opening block: followed, it sent every conversation to one replica."""
    router = Router(["a", "b"], min_share=0.5)
    template = SYSTEM[:4]  # one block of block_size 4
    assert [router.route(chain(*template, 60 + i, 1, 2, 3, 4, 5), prompt_blocks=2.5) for i in range(4)] == [
        "a", "b", "a", "b"]  # the shared block is 1 of 2.5 blocks: spread
    router = Router(["a", "b"], min_share=0.5)
    followed = [router.route(chain(*SYSTEM, 60 + i), prompt_blocks=4.25) for i in range(3)]
    assert followed == ["a"] * 3  # 4 of 4.25 blocks: followed
    assert Router(["a", "b"], min_share=0.0).choose(chain(*template), prompt_blocks=100) == "a"


def test_short_prompt_has_no_blocks_and_goes_least_loaded():
    router = Router(NAMES)
    router.load.update(r0=3, r1=1, r2=2)
    assert chain(1, 2, 3) == [] and router.choose([]) == "r1"


def test_overload_falls_back_to_least_loaded_by_absolute_and_relative_threshold():
    router = Router(["a", "b"], abs_threshold=4, rel_threshold=1.5)
    hashes = chain(*SYSTEM)
    assert router.route(hashes) == "a"
    router.load.update(a=6, b=1)  # 5 more than b (> 4) and 6 > 1.5 x 1
    assert router.choose(hashes) == "b"
    router.load.update(a=5, b=1)  # only 4 more: stays
    assert router.choose(hashes) == "a"
    router.load.update(a=20, b=15)  # 5 more, but 20 < 1.5 x 15: stays
    assert router.choose(hashes) == "a"


def test_longest_known_prefix_wins():
    router = Router(["a", "b"])
    short, long_ = chain(*SYSTEM[:8]), chain(*SYSTEM)
    assert router.route(short) == "a"
    router.mark_down("a")
    assert router.route(long_) == "b"  # a is down: its prefixes are forgotten, b learns the chain
    router.mark_up("a")
    router.release("b")
    assert router.choose(long_) == "b" and router.choose(short) == "b"


def test_round_robin_and_least_loaded_skip_down_replicas():
    rr = Router(NAMES, "round-robin")
    assert [rr.route([]) for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    rr.mark_down("r1")
    assert [rr.route([]) for _ in range(3)] == ["r2", "r0", "r2"]
    ll = Router(NAMES, "least-loaded")
    ll.load.update(r0=2, r1=0, r2=1)
    ll.mark_down("r1")
    assert ll.route(chain(*SYSTEM)) == "r2"
    assert ll.num_prefix_entries == 0  # only the prefix policy remembers prefixes
    ll.mark_down("r0")
    ll.mark_down("r2")
    assert ll.route([]) is None


def test_release_pairs_with_route_and_bad_input_is_refused():
    router = Router(["a"])
    with pytest.raises(ValueError, match="without a routed request"):
        router.release("a")
    with pytest.raises(ValueError, match="must be one of"):
        Router(["a"], "random")
    with pytest.raises(ValueError, match="distinct"):
        Router(["a", "a"])


def test_prefix_table_is_bounded_lru():
    router = Router(["a", "b"], max_prefix_entries=3)
    old = chain(1, 1, 1, 1)
    router.route(old)
    router.route(chain(2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4))
    assert router.num_prefix_entries == 3 and router.owner(old[0]) is None
    router.check_invariants()


# --- the shadow model ---------------------------------------------------------------------------


class Reference:
    """The same policy written plainly: an ordered list of (hash, owner), newest last."""

    def __init__(self, names, policy, abs_threshold, rel_threshold, max_entries, min_share):
        self.names, self.policy, self.min_share = names, policy, min_share
        self.abs, self.rel, self.max = abs_threshold, rel_threshold, max_entries
        self.load = {n: 0 for n in names}
        self.healthy = set(names)
        self.entries: list[tuple[bytes, str]] = []
        self.turn = 0

    def choose(self, hashes, prompt_blocks):
        order = [self.names[(self.turn + i) % len(self.names)] for i in range(len(self.names))]
        live = [n for n in order if n in self.healthy]
        if not live:
            return None
        lowest = min(self.load[n] for n in live)
        least = next(n for n in live if self.load[n] == lowest)
        if self.policy == "round-robin":
            return live[0]
        if self.policy == "least-loaded":
            return least
        owners = dict(self.entries)
        known = [(i, owners[h]) for i, h in enumerate(hashes) if h in owners]
        if not known or known[-1][0] + 1 < self.min_share * prompt_blocks:
            return least
        match = known[-1][1]
        if self.load[match] - lowest > self.abs and self.load[match] > self.rel * lowest:
            return least
        return match

    def route(self, hashes, prompt_blocks):
        name = self.choose(hashes, prompt_blocks)
        if name is None:
            return None
        self.turn = (self.names.index(name) + 1) % len(self.names)
        self.load[name] += 1
        if self.policy == "prefix":
            for h in hashes:
                self.entries = [e for e in self.entries if e[0] != h] + [(h, name)]
            self.entries = self.entries[-self.max:]
        return name

    def mark_down(self, name):
        self.healthy.discard(name)
        self.entries = [e for e in self.entries if e[1] != name]


# a few shared "system prompts" (two blocks each, or none) and a short random tail
PROMPTS = st.builds(lambda head, tail: [*head, *tail], st.sampled_from([(), (1, 2, 3, 4), (5, 6, 7, 8), (1, 2, 9, 9)]),
                    st.lists(st.integers(0, 3), max_size=6))


class RouterMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["prefix", "prefix", "round-robin", "least-loaded"]),
                abs_threshold=st.integers(0, 3), rel_threshold=st.sampled_from([1.0, 1.5, 3.0]),
                max_entries=st.integers(1, 8), min_share=st.sampled_from([0.0, 0.5, 0.9]))
    def init(self, policy, abs_threshold, rel_threshold, max_entries, min_share):
        args = (NAMES, policy, abs_threshold, rel_threshold, max_entries, min_share)
        self.router = Router(NAMES, policy, abs_threshold=abs_threshold, rel_threshold=rel_threshold,
                             max_prefix_entries=max_entries, min_share=min_share)
        self.ref = Reference(*args)

    @rule(tokens=PROMPTS)
    def route(self, tokens):
        hashes = chain(*tokens, block_size=2)
        assert self.router.route(hashes, len(tokens) / 2) == self.ref.route(hashes, len(tokens) / 2)

    @rule(tokens=PROMPTS)
    def route_again(self, tokens):  # twice as many routes as releases: loads grow apart
        hashes = chain(*tokens, block_size=2)
        assert self.router.route(hashes, len(tokens) / 2) == self.ref.route(hashes, len(tokens) / 2)

    @rule(name=st.sampled_from(NAMES))
    def release(self, name):
        if self.ref.load[name] == 0:
            with pytest.raises(ValueError):
                self.router.release(name)
            return
        self.router.release(name)
        self.ref.load[name] -= 1

    @rule(name=st.sampled_from(NAMES))
    def mark_down(self, name):
        self.router.mark_down(name)
        self.ref.mark_down(name)

    @rule(name=st.sampled_from(NAMES))
    def mark_up(self, name):  # a restarted replica: its load and the others' prefixes carry on
        self.router.mark_up(name)
        self.ref.healthy.add(name)

    @invariant()
    def agrees(self):
        self.router.check_invariants()
        assert self.router.load == self.ref.load
        assert self.router.healthy == self.ref.healthy
        assert list(self.router._owner.items()) == self.ref.entries


RouterMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_router_matches_reference = RouterMachine.TestCase
