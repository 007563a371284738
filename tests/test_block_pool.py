"""BlockPool, the pure KV-block logic: allocation, reference counts, prefix caching, LRU
eviction, forking with copy-on-write — unit tests plus a hypothesis state machine that checks
the invariants (that every prefix-cache hit really holds the KV of the same prefix, and that
nobody writes a block somebody else holds) after every operation."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool


def state(pool: BlockPool) -> dict:
    """Everything allocate/commit/free may touch (for "no change" checks)."""
    return copy.deepcopy({
        "ref": pool.ref_count, "free": list(pool.free_blocks), "evictable": list(pool.evictable),
        "hash": pool.block_hash, "cached": pool.cached, "tables": pool.tables, "hashed": pool.num_hashed,
        "last": pool.last_hash, "queried": pool.num_queried_tokens, "hits": pool.num_hit_tokens, "cow": pool.cow,
    })


def check(pool: BlockPool) -> None:
    pool.check_invariants()
    # the hash maps mirror each other, and only blocks that hold KV (owned or evictable) are hashed
    assert {b: h for h, b in pool.cached.items()} == pool.block_hash
    assert set(pool.evictable) <= set(pool.block_hash)
    assert not set(pool.free_blocks) & set(pool.block_hash)


# --- allocation and reference counts -----------------------------------------------------------


def test_allocate_grow_and_free():
    pool = BlockPool(8, 4)
    a = pool.allocate("a", 5)
    assert len(a.block_table) == 2 and a.num_cached_tokens == 0
    assert all(pool.ref_count[b] == 1 for b in a.block_table)
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 2 and pool.usage == 2 / 8
    # growing keeps the existing blocks and appends
    a2 = pool.allocate("a", 9)
    assert a2.block_table[:2] == a.block_table and len(a2.block_table) == 3
    # asking for fewer tokens than owned changes nothing
    assert pool.allocate("a", 3).block_table == a2.block_table
    b = pool.allocate("b", 4)
    assert not set(b.block_table) & set(a2.block_table)
    check(pool)
    pool.free("a")
    assert all(pool.ref_count[x] == 0 for x in a2.block_table)
    assert pool.num_free_blocks == 7
    check(pool)
    pool.free("a")  # unknown / already freed: a no-op
    pool.free("never-seen")
    pool.free("b")
    assert pool.num_free_blocks == 8 and pool.usage == 0
    check(pool)


def test_returned_table_is_a_copy():
    pool = BlockPool(4, 2)
    alloc = pool.allocate("a", 2)
    alloc.block_table.append(3)
    assert pool.tables["a"] == alloc.block_table[:1]
    check(pool)


def test_full_pool_returns_none_and_changes_nothing():
    pool = BlockPool(4, 4)
    pool.allocate("a", 8, list(range(8)))
    pool.commit("a", list(range(8)), 8)
    pool.allocate("b", 4)
    before = state(pool)
    assert pool.allocate("c", 9, list(range(100, 109))) is None  # needs 3, 1 free
    assert pool.allocate("b", 13) is None  # b needs 3 more, 1 free
    assert state(pool) == before
    assert "c" not in pool.tables
    # exactly the free amount still works
    assert pool.allocate("c", 4, list(range(100, 104))) is not None
    assert pool.num_free_blocks == 0
    assert pool.allocate("d", 1) is None
    check(pool)


def test_full_pool_with_evictable_blocks_counts_them_free():
    pool = BlockPool(3, 2)
    toks = [1, 2, 3, 4, 5, 6]
    pool.allocate("a", 6, toks)
    pool.commit("a", toks, 6)
    pool.free("a")
    assert len(pool.evictable) == 3 and pool.num_free_blocks == 3 and pool.usage == 0
    assert pool.allocate("b", 6, [9, 9, 9, 9, 9, 9]) is not None  # evicts all three
    assert not pool.evictable and not pool.cached
    check(pool)


def test_revived_hits_are_not_counted_as_free():
    # a's 2 hashed blocks sit in the LRU; c hits both (reviving them) and needs 2 fresh
    # blocks, but only 1 non-hit block is left: the pool must refuse, not evict its own hits.
    pool = BlockPool(3, 2)
    toks = [1, 2, 3, 4]
    pool.allocate("a", 4, toks)
    pool.commit("a", toks, 4)
    pool.free("a")
    before = state(pool)
    assert pool.allocate("c", 8, toks + [5, 6, 7, 8, 9]) is None
    assert state(pool) == before
    got = pool.allocate("c", 6, toks + [5, 6, 7])
    assert got is not None and got.num_cached_tokens == 4
    check(pool)


# --- prefix caching ---------------------------------------------------------------------------


def test_no_hit_before_commit():
    pool = BlockPool(16, 4)
    toks = list(range(20))
    pool.allocate("a", 20, toks)
    b = pool.allocate("b", 1, toks + [99])
    assert b.num_cached_tokens == 0
    check(pool)


def test_prefix_hit_after_commit_shares_blocks():
    pool = BlockPool(16, 4)
    toks = list(range(20))
    a = pool.allocate("a", 20, toks)
    pool.commit("a", toks, 20)
    b = pool.allocate("b", 1, toks[:13] + [77, 78])  # 13 shared tokens = 3 whole blocks
    assert b.num_cached_tokens == 12
    assert b.block_table == a.block_table[:3]
    assert all(pool.ref_count[x] == 2 for x in a.block_table[:3])
    b2 = pool.allocate("b", 15)
    assert b2.block_table[:3] == a.block_table[:3] and b2.block_table[3] not in a.block_table
    assert pool.num_hit_tokens == 12 and pool.num_queried_tokens == 20 + 15  # a's lookup + b's
    assert pool.hit_rate == pytest.approx(12 / 35)
    check(pool)
    pool.free("a")
    assert all(pool.ref_count[x] == 1 for x in a.block_table[:3])  # b still holds the shared head
    check(pool)


def test_partial_commit_hashes_only_full_computed_blocks():
    pool = BlockPool(16, 4)
    toks = list(range(20))
    pool.allocate("a", 20, toks)
    pool.commit("a", toks, 10)  # 2 full blocks computed
    assert pool.allocate("b", 1, toks).num_cached_tokens == 8
    pool.commit("a", toks, 20)  # the rest, incrementally
    assert pool.allocate("c", 1, toks + [1]).num_cached_tokens == 20
    check(pool)


def test_hit_needs_the_whole_prefix():
    pool = BlockPool(16, 4)
    toks = list(range(12))
    pool.allocate("a", 12, toks)
    pool.commit("a", toks, 12)
    # same second block, different first block: the chained hash must miss
    assert pool.allocate("b", 1, [50, 51, 52, 53] + toks[4:] + [0]).num_cached_tokens == 0
    check(pool)


def test_never_hits_the_block_of_the_last_token():
    pool = BlockPool(16, 4)
    toks = list(range(8))
    pool.allocate("a", 8, toks)
    pool.commit("a", toks, 8)
    # identical 8-token prompt: its last token sits in block 2, which must be recomputed
    assert pool.allocate("same", 1, toks).num_cached_tokens == 4
    # one more token: both blocks are strictly before the last token
    assert pool.allocate("longer", 1, toks + [8]).num_cached_tokens == 8
    # a one-token prompt never hits
    assert pool.allocate("one", 1, toks[:1]).num_cached_tokens == 0
    check(pool)


def test_prefix_caching_disabled():
    pool = BlockPool(16, 4, enable_prefix_caching=False)
    toks = list(range(20))
    pool.allocate("a", 20, toks)
    pool.commit("a", toks, 20)
    assert not pool.cached
    assert pool.allocate("b", 1, toks + [1]).num_cached_tokens == 0
    pool.free("a")
    assert not pool.evictable and pool.num_free_blocks == 16 - 1
    check(pool)


def test_hit_from_evictable_lru_and_refcount_back_to_owner():
    pool = BlockPool(8, 4)
    toks = list(range(16))
    a = pool.allocate("a", 16, toks)
    pool.commit("a", toks, 16)
    pool.free("a")
    assert set(pool.evictable) == set(a.block_table)
    b = pool.allocate("b", 1, toks + [1])
    assert b.num_cached_tokens == 16 and b.block_table == a.block_table
    assert not pool.evictable
    check(pool)


# --- forking (n > 1) ---------------------------------------------------------------------------


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    pool = BlockPool(8, 4)
    toks = list(range(10))  # 2 full blocks + 2 tokens in a third
    pool.allocate("a", 10, toks)
    pool.commit("a", toks, 10)
    parent = list(pool.tables["a"])
    pool.fork("a", "b", 10)
    pool.fork("a", "c", 10)
    assert pool.tables["b"] == pool.tables["c"] == parent
    assert [pool.ref_count[x] for x in parent] == [3, 3, 3]
    assert pool.num_free_blocks == 5  # a fork takes no block
    check(pool)
    # b's next token goes into the shared partial block: b gets a private copy of it
    got = pool.allocate("b", 11)
    assert got.copied == (parent[2], got.block_table[2]) and got.block_table[:2] == parent[:2]
    assert got.block_table[2] not in parent and pool.ref_count[parent[2]] == 2
    assert pool.allocate("b", 12).copied is None  # once only
    # a grows past its blocks: a copy and a new block
    got = pool.allocate("a", 13)
    assert got.copied is not None and len(got.block_table) == 4 and pool.ref_count[parent[2]] == 1
    # c is the last holder: it writes the original in place
    got = pool.allocate("c", 11)
    assert got.copied is None and got.block_table == parent
    check(pool)
    for rid in "abc":
        pool.free(rid)
    assert pool.num_free_blocks == 8 and all(r == 0 for r in pool.ref_count)
    check(pool)


def test_fork_on_a_block_boundary_copies_nothing():
    pool = BlockPool(8, 4)
    pool.allocate("a", 8)
    pool.fork("a", "b", 8)
    assert not pool.cow
    assert pool.allocate("b", 9).copied is None and pool.allocate("a", 9).copied is None
    assert pool.tables["a"][:2] == pool.tables["b"][:2] and pool.tables["a"][2] != pool.tables["b"][2]
    check(pool)


def test_a_copy_needs_a_free_block_or_the_growth_is_refused():
    pool = BlockPool(3, 4)
    pool.allocate("a", 6)
    pool.fork("a", "b", 6)
    pool.allocate("x", 4)  # the last free block
    before = state(pool)
    assert pool.needs_copy("b")
    assert pool.allocate("b", 7) is None
    assert state(pool) == before
    pool.free("a")  # the partial block is b's alone now: written in place, no block needed
    assert not pool.needs_copy("b") and pool.allocate("b", 7).copied is None
    check(pool)


# --- LRU eviction -----------------------------------------------------------------------------


def test_fresh_blocks_come_from_never_hashed_first():
    pool = BlockPool(4, 2)
    toks = [1, 2, 3, 4]
    pool.allocate("a", 4, toks)
    pool.commit("a", toks, 4)
    pool.free("a")
    pool.allocate("b", 4)  # two never-used blocks are still free: the cached ones survive
    assert pool.allocate("c", 1, toks + [5]).num_cached_tokens == 4
    check(pool)


def test_lru_evicts_least_recently_freed_tail_first():
    bs = 2
    pool = BlockPool(4, bs)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    pool.allocate("a", 4, a)
    pool.commit("a", a, 4)
    pool.allocate("b", 4, b)
    pool.commit("b", b, 4)
    a_table, b_table = pool.tables["a"], pool.tables["b"]
    pool.free("a")
    pool.free("b")
    # LRU order: a's tail, a's head, b's tail, b's head
    assert list(pool.evictable) == [a_table[1], a_table[0], b_table[1], b_table[0]]

    def cached_tokens(toks: list[int]) -> int:
        """Probe the cache without disturbing it (allocate + free of a 1-token request would revive)."""
        return len(pool._lookup(toks)) * bs

    assert cached_tokens(a + [0]) == 4 and cached_tokens(b + [0]) == 4
    pool.allocate("x", 2)  # one fresh block: evicts a's tail
    assert cached_tokens(a + [0]) == 2 and cached_tokens(b + [0]) == 4
    pool.allocate("x", 4)  # next: a's head
    assert cached_tokens(a + [0]) == 0 and cached_tokens(b + [0]) == 4
    pool.allocate("x", 6)  # then b's tail
    assert cached_tokens(b + [0]) == 2
    check(pool)


def test_revived_block_moves_to_most_recent():
    bs = 2
    pool = BlockPool(4, bs)
    a, b = [1, 2], [3, 4]
    for rid, toks in (("a", a), ("b", b)):
        pool.allocate(rid, 2, toks)
        pool.commit(rid, toks, 2)
    pool.free("a")
    pool.free("b")  # LRU: a, b
    pool.allocate("a2", 1, a + [0])  # revive a's block, then let it go again: LRU b, a
    pool.free("a2")
    assert list(pool.evictable) == [pool._lookup(b + [0])[0], pool._lookup(a + [0])[0]]
    pool.allocate("x", 6)  # 2 never-hashed blocks, then the LRU one: b's
    assert pool._lookup(a + [0]) and not pool._lookup(b + [0])
    check(pool)


# --- random operations: a state machine ---------------------------------------------------------

BS = 2
NUM_BLOCKS = 8
TOKENS = st.integers(0, 2)  # a tiny alphabet: prefixes collide often


class PoolMachine(RuleBasedStateMachine):
    """Drives the pool the way the scheduler does (allocate → compute → commit → free) and keeps
    a shadow of what KV each block slot holds, identified by the whole prefix it was computed
    for. A prefix-cache hit must hand out blocks whose every slot holds exactly that prefix."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.reqs: dict[str, dict] = {}  # id -> {tokens, computed, granted (tokens it may hold)}
        self.kv: dict[int, tuple] = {}  # slot -> prefix tuple whose last token's KV is stored there
        self.next_id = 0

    def _slot(self, rid: str, pos: int) -> int:
        table = self.pool.tables[rid]
        return table[pos // BS] * BS + pos % BS

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=10), extra=st.integers(0, 6))
    def add(self, prompt, extra):
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = state(self.pool)
        alloc = self.pool.allocate(rid, 1, prompt)  # the scheduler's first call: prefix lookup
        if alloc is None:
            assert state(self.pool) == before, "a refused allocation changed the pool"
            return
        cached = alloc.num_cached_tokens
        assert cached % BS == 0 and cached <= len(prompt) - 1
        for pos in range(cached):  # every hit slot holds the KV of exactly this prefix
            assert self.kv.get(self._slot(rid, pos)) == tuple(prompt[: pos + 1]), "prefix hit on wrong KV"
        self.reqs[rid] = {"tokens": list(prompt), "computed": cached, "granted": max(cached, 1)}
        self._grow(rid, min(len(prompt), cached + 1 + extra))

    def _grow(self, rid: str, num_tokens: int) -> None:
        before = state(self.pool)
        old = list(self.pool.tables[rid])
        holds = self.pool.holds(rid, num_tokens)
        alloc = self.pool.allocate(rid, num_tokens)
        if holds:  # the block manager skips such a growth: it must be one that changes nothing
            assert alloc is not None and alloc.copied is None and alloc.block_table == old
            assert state(self.pool) == before
        if alloc is None:
            assert state(self.pool) == before, "a refused allocation changed the pool"
            return
        if alloc.copied is not None:  # what the executor does before the step writes
            src, dst = alloc.copied
            src_i = old.index(src)
            assert alloc.block_table[src_i] == dst
            assert self.pool.ref_count[dst] == 1 and self.pool.ref_count[src] >= 1
            old[src_i] = dst
            for o in range(BS):
                if src * BS + o in self.kv:
                    self.kv[dst * BS + o] = self.kv[src * BS + o]
                else:
                    self.kv.pop(dst * BS + o, None)
        assert alloc.block_table[: len(old)] == old
        assert len(alloc.block_table) * BS >= num_tokens
        self.reqs[rid]["granted"] = max(self.reqs[rid]["granted"], num_tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def compute_and_commit(self, data):
        """A step: compute some of the owned-but-uncomputed tokens, write their KV, commit."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        capacity = min(len(self.pool.tables[rid]) * BS, len(req["tokens"]), req["granted"])
        if capacity <= req["computed"]:
            return
        upto = data.draw(st.integers(req["computed"] + 1, capacity))
        for pos in range(req["computed"], upto):
            block = self.pool.tables[rid][pos // BS]
            assert self.pool.ref_count[block] == 1, "writing KV into a block somebody else shares"
            assert block not in self.pool.block_hash, "writing KV into a hashed (shareable) block"
            self.kv[self._slot(rid, pos)] = tuple(req["tokens"][: pos + 1])
        req["computed"] = upto
        self.pool.commit(rid, list(req["tokens"]), upto)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=TOKENS, more=st.integers(1, 4))
    def decode(self, data, token, more):
        """A sampled token extends the sequence; allocate room for it (and maybe more)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        if req["computed"] < len(req["tokens"]):
            self._grow(rid, min(len(req["tokens"]), req["computed"] + more))
            return
        req["tokens"].append(token)
        self._grow(rid, len(req["tokens"]))

    @precondition(lambda self: any(r["computed"] == len(r["tokens"]) for r in self.reqs.values()))
    @rule(data=st.data())
    def fork(self, data):
        """n > 1: a request whose tokens are all computed (its prompt just prefilled) forks a
        choice. Neither writes again before a growth (which copies a shared partial block)."""
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.reqs.items() if v["computed"] == len(v["tokens"]))))
        req = self.reqs[rid]
        child = f"f{self.next_id}"
        self.next_id += 1
        before = [self.pool.ref_count[b] for b in self.pool.tables[rid]]
        self.pool.fork(rid, child, req["computed"])
        assert self.pool.tables[child] == self.pool.tables[rid][: self.pool.blocks_for(req["computed"])]
        assert [self.pool.ref_count[b] for b in self.pool.tables[child]] == [r + 1 for r in before[: len(self.pool.tables[child])]]
        req["granted"] = req["computed"]
        self.reqs[child] = {"tokens": list(req["tokens"]), "computed": req["computed"], "granted": req["computed"]}

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[rid]
        self.pool.free(rid)
        assert rid not in self.pool.tables

    @rule(n=st.integers(1, NUM_BLOCKS * BS))
    def allocate_plain(self, n):
        """A request without prefix lookup (e.g. the static policy), freed at once."""
        rid = f"p{self.next_id}"
        self.next_id += 1
        before = state(self.pool)
        if self.pool.allocate(rid, n) is None:
            assert state(self.pool) == before
            assert self.pool.blocks_for(n) > self.pool.num_free_blocks
        else:
            self.pool.free(rid)

    @invariant()
    def consistent(self):
        check(self.pool)
        assert set(self.pool.tables) == set(self.reqs)
        for rid, req in self.reqs.items():
            assert len(self.pool.tables[rid]) * BS >= req["computed"]


PoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPoolMachine = PoolMachine.TestCase


def test_a_salted_prefix_is_shared_only_with_its_own_salt():
    from engine.block_hash import salted_root

    pool = BlockPool(16, 4, True)
    prompt = list(range(10, 23))  # 3 full blocks and one token
    for request_id, salt in [("a", "s1"), ("plain", None)]:
        assert pool.admit(request_id, prompt, len(prompt), len(prompt), 1, salted_root(salt)) == (0, len(prompt))
        pool.commit(request_id, prompt, len(prompt))
        pool.free(request_id)
    assert pool.admit("b", prompt, len(prompt), len(prompt), 1, salted_root("s2"))[0] == 0
    assert pool.admit("c", prompt, len(prompt), len(prompt), 1, salted_root("s1"))[0] == 12
    assert pool.admit("d", prompt, len(prompt), len(prompt), 1)[0] == 12  # the unsalted chain of "plain"
    pool.check_invariants()
