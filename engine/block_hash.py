"""The identity of a full KV block: a collision-resistant hash chained over whole prefixes.

hash(block i) = BLAKE2b-256(hash(block i-1) || token ids of block i as little-endian int64).
Equal hashes mean equal whole prefixes (to 2^-128 collision odds), so a prefix-cache hit can
be trusted without comparing tokens. Python's built-in hash() of tuples is not: collisions can
be crafted, and a crafted one would hand one request another's KV (cf. vLLM CVE-2025-25183).
The hash is unkeyed and stable across processes, so a router can compute the same chain.
A request's `cache_salt` (vLLM's) starts its chain from a root of its own: only requests with
the same salt share blocks, so a client cannot learn another's prompt by timing or by
`cached_tokens`.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence

ROOT = bytes(32)  # the parent of a prompt's first block


def salted_root(cache_salt: str | None) -> bytes | None:
    """The parent of a salted prompt's first block (None: the shared ROOT)."""
    if not cache_salt:
        return None
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass"), digest_size=32).digest()


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(parent or ROOT, digest_size=32)
    h.update(ids.tobytes())
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                        root: bytes | None = None) -> Iterator[bytes]:
    """The chain of hashes of the full blocks of `token_ids`, first block first, from `root`
    (a salted_root; None: ROOT)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    parent = root
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        yield parent
