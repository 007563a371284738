"""Block hashes: a chain over whole prefixes that crafted inputs cannot collide."""

from engine.block_hash import hash_block, prefix_block_hashes
from engine.block_pool import BlockPool


def test_chain_depends_on_every_token_and_the_parent():
    a = list(prefix_block_hashes(list(range(48)), 16))
    assert len(a) == 3 and len(set(a)) == 3
    b = list(prefix_block_hashes([99] + list(range(1, 48)), 16))
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 changes every later hash
    assert hash_block(None, range(16)) == a[0]
    assert hash_block(a[0], range(16, 32)) == a[1]
    assert hash_block(None, [1]) != hash_block(None, [1, 0])  # length is part of the bytes


def test_stable_across_calls_and_processes():
    # a fixed value: routers in other processes compute the same chain
    assert hash_block(None, [1, 2, 3]).hex()[:16] == hash_block(None, (1, 2, 3)).hex()[:16]
    assert len(hash_block(None, [1, 2, 3])) == 32


def test_max_blocks():
    assert len(list(prefix_block_hashes(list(range(100)), 16, max_blocks=2))) == 2


def test_python_hash_collisions_do_not_share_kv():
    # hash(2**61 - 1) == hash(0) in CPython: with hash() of tuples these two prompts had the
    # same block key and the second request reused the first one's KV.
    pool = BlockPool(num_blocks=8, block_size=4)
    first = [2**61 - 1] * 4 + [7]
    pool.allocate("a", len(first), first)
    pool.commit("a", first, len(first))
    second = [0] * 4 + [7]
    alloc = pool.allocate("b", len(second), second)
    assert alloc.num_cached_tokens == 0
    third = list(first)
    assert pool.allocate("c", len(third), third).num_cached_tokens == 4  # a true hit still hits
    pool.check_invariants()
