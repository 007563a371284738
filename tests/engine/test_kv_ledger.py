"""The scheduler's KV ledger against the real pool: one message per step, and the ledger's
estimate stays exact (no prefix sharing) or safe (sharing: refusals are reported, not lost)."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.kv_ledger import KVLedger


def settle(manager: BlockManager, ledger: KVLedger):
    grant = manager.apply(ledger.take())
    ledger.apply(grant)
    manager.check_invariants()
    return grant


@pytest.mark.parametrize("seed", range(20))
def test_the_ledger_tracks_the_pool_exactly_without_sharing(seed):
    rng = random.Random(seed)
    manager, ledger = BlockManager(24, 4, enable_prefix_caching=False), KVLedger(24, 4)
    tokens: dict[str, int] = {}  # request -> tokens it holds
    for step in range(60):
        for rid in list(tokens):
            if rng.random() < 0.2:
                ledger.free(rid)
                del tokens[rid]
            elif ledger.grow(rid, n := tokens[rid] + rng.randint(1, 6)):
                tokens[rid] = n
        rid = f"r{step}"
        want = rng.randint(1, 20)
        if got := ledger.admit(rid, [7] * want, False, want, rng.choice([1, want])):
            tokens[rid] = got
        grant = settle(manager, ledger)
        assert not grant.refused  # without shared blocks the ledger never promises too much
        assert all(grant.admitted[r].num_new_tokens == n for r, n in tokens.items() if r in grant.admitted)
        assert ledger.num_free_blocks == manager.figures.num_free_blocks
        assert {r: len(t) for r, t in ledger.tables.items()} == {r: ledger.held[r] for r in ledger.tables}
        assert sum(ledger.held.values()) == 24 - ledger.num_free_blocks


def test_a_growth_inside_the_blocks_held_sends_nothing():
    manager, ledger = BlockManager(8, 4, enable_prefix_caching=False), KVLedger(8, 4)
    ledger.admit("a", [1, 2, 3], False, 3, 3)
    table = settle(manager, ledger).tables["a"]
    assert ledger.grow("a", 4)  # the 4th token fits the block it holds: the pool has nothing to do
    assert ledger.take().grows == []
    assert ledger.grow("a", 5)  # the 5th needs a second block
    grant = settle(manager, ledger)
    assert list(grant.tables) == ["a"] and ledger.tables["a"] is table and len(table) == 2
    assert ledger.held["a"] == 2 and ledger.num_free_blocks == manager.figures.num_free_blocks == 6


def test_an_admission_finds_its_prefix_hits_in_the_pool():
    manager, ledger = BlockManager(16, 4, enable_prefix_caching=True), KVLedger(16, 4)
    prompt = list(range(3, 15))  # 12 tokens: 3 full blocks
    assert ledger.admit("a", prompt, True, 12, 12) == 12
    settle(manager, ledger)
    ledger.commit([("a", prompt, 12)])
    ledger.free("a")
    assert ledger.admit("b", prompt + [99], True, 13, 13) == 13  # planned as if nothing were cached
    grant = settle(manager, ledger)
    got = grant.admitted["b"]
    assert (got.num_cached_tokens, got.num_new_tokens) == (12, 1)  # the pool found a's blocks
    assert ledger.held["b"] == 4 and ledger.num_free_blocks == manager.figures.num_free_blocks


def test_a_refused_growth_is_reported_and_the_less_important_get_nothing():
    manager, ledger = BlockManager(8, 2, enable_prefix_caching=True), KVLedger(8, 2)
    shared = [5, 6, 7, 8]
    ledger.admit("a", shared + [1], True, 5, 5)
    settle(manager, ledger)
    ledger.commit([("a", shared + [1], 5)])
    ledger.admit("b", shared + [2], True, 5, 5)  # shares a's two full blocks
    settle(manager, ledger)
    assert manager.figures.num_free_blocks == 8 - 3 - 1
    ledger.free("a")  # the ledger counts a's 3 blocks back; the pool frees only 1 (2 are b's too)
    assert ledger.num_free_blocks == 7
    assert ledger.grow("b", 5 + 12)  # 6 more blocks: the ledger thinks they are there, the pool has 5
    assert ledger.admit("c", [9, 9], True, 2, 2) == 2
    grant = settle(manager, ledger)
    assert grant.refused == ["b"] and grant.admitted["c"].num_new_tokens == 0
    assert ledger.held["b"] == 3 and "c" not in ledger.held  # as the pool has them
    assert ledger.num_free_blocks == manager.figures.num_free_blocks == 5


def test_one_message_per_take():
    manager, ledger = BlockManager(8, 2, enable_prefix_caching=False), KVLedger(8, 2)
    ledger.admit("a", [1, 2, 3], False, 3, 3)
    ledger.admit("b", [4], False, 1, 1)
    ledger.commit([("a", [1, 2, 3], 3)])
    step = ledger.take()
    assert len(step.admits) == 2 and len(step.commits) == 1 and not ledger.has_changes
    manager.apply(step)
    assert manager.num_messages == 1


def test_forks_share_blocks_and_the_grant_carries_the_copies():
    """n = 3 choices of a 10-token prompt (block size 4): the forks take no block; the first
    growth of each sharer of the partial last block copies it, except the last one's (it holds
    the block alone by then); the ledger plans one block per possible copy (never too few)."""
    manager, ledger = BlockManager(16, 4, enable_prefix_caching=True), KVLedger(16, 4)
    prompt = list(range(3, 13))
    ledger.admit("a", prompt, True, 10, 10)
    settle(manager, ledger)
    ledger.commit([("a", prompt, 10)])
    ledger.fork("a", "a#1", 10)
    ledger.fork("a", "a#2", 10)
    grant = settle(manager, ledger)
    assert grant.tables["a#1"] == grant.tables["a#2"] == ledger.tables["a"]
    assert ledger.num_free_blocks == manager.figures.num_free_blocks == 16 - 3
    assert not grant.copies
    for rid in ("a#2", "a", "a#1"):
        assert ledger.grow(rid, 11)
    assert ledger.num_free_blocks == 16 - 3 - 3  # planned: a copy each
    grant = settle(manager, ledger)
    assert not grant.refused and len(grant.copies) == 2
    src = {s for s, _ in grant.copies}
    assert src == {ledger.tables["a#1"][2]}  # the last sharer kept the original
    assert ledger.take_copies() == grant.copies and ledger.take_copies() == []
    assert ledger.num_free_blocks == manager.figures.num_free_blocks == 16 - 5
    assert len({t[2] for t in ledger.tables.values()}) == 3 and len({t[1] for t in ledger.tables.values()}) == 1
    for rid in ("a", "a#1", "a#2"):
        ledger.free(rid)
    settle(manager, ledger)
    assert ledger.num_free_blocks == manager.figures.num_free_blocks == 16


def test_a_fork_freed_in_the_step_it_forks_is_gone():
    manager, ledger = BlockManager(8, 4, enable_prefix_caching=False), KVLedger(8, 4)
    ledger.admit("a", [5] * 6, False, 6, 6)
    settle(manager, ledger)
    ledger.fork("a", "a#1", 6)
    ledger.free("a#1")  # ended on its first token
    ledger.free("a")
    grant = settle(manager, ledger)
    assert "a#1" not in grant.tables and not ledger.tables and not ledger.held
    assert manager.figures.num_free_blocks == 8
