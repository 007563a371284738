"""The KV block pool: allocation, reference counts and prefix caching, as plain logic.

A full block is identified by a collision-resistant hash chained with its predecessor's
(engine/block_hash.py: equal hashes mean equal whole prefixes). Blocks whose last owner left keep their hash and sit in an LRU list:
a later request with the same prefix takes them back for free; a request needing fresh
blocks evicts the least recently freed one. The block manager actor owns one BlockPool;
property tests drive it directly.

Forking (n > 1 choices from one prompt): a child starts with its parent's table, every block
shared by reference count. Full blocks are never written again, so sharing them is free; the
partly filled last block will be written by every sharer, so it is copy-on-write: each
sharer's next growth takes a private copy while others still hold it (the last one writes
in place). The copy itself is KV memory, the executor's: the growth reports (src, dst) and
the block manager passes it on in its grant.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.block_hash import hash_block, prefix_block_hashes


@dataclass
class Allocation:
    block_table: list[int]
    num_cached_tokens: int  # leading tokens whose KV is already in the cache
    copied: tuple[int, int] | None = None  # (src, dst): copy-on-write, the KV of src must be copied to dst


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, still hashed: LRU first
        self.block_hash: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.tables: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}  # leading blocks of a request already hashed
        self.last_hash: dict[str, bytes | None] = {}
        self.cow: dict[str, int] = {}  # request id -> index of the shared partial block it writes next
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # --- figures ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                 root: bytes | None = None) -> Allocation | None:
        """Make `request_id` own enough blocks for `num_tokens` tokens. A request's first
        allocation looks up its prefix among `token_ids`. None (and no change) if the pool
        cannot supply the blocks."""
        hits: list[int] = []
        if request_id not in self.tables and token_ids is not None and self.enable_prefix_caching:
            hits = self._lookup(token_ids, root)
        return self._allocate(request_id, num_tokens, hits, len(token_ids or ()) if request_id not in self.tables else 0,
                              root)

    def _allocate(self, request_id: str, num_tokens: int, hits: list[int], queried: int,
                  root: bytes | None = None, counted: bool = True) -> Allocation | None:
        table = self.tables.get(request_id, [])
        needed = self.blocks_for(num_tokens) - len(table) - len(hits)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        cow = self.cow.get(request_id)
        copy = cow is not None and self.ref_count[table[cow]] > 1
        if max(0, needed) + copy > self.num_free_blocks - revived:
            return None
        copied = None
        if cow is not None:
            del self.cow[request_id]
            if copy:  # others still hold the block: write into a private copy of it
                src, dst = table[cow], self._take_fresh()
                self.ref_count[src] -= 1
                table[cow] = dst
                copied = (src, dst)
        if request_id not in self.tables:
            self.tables[request_id] = table
            self.num_hashed[request_id] = len(hits)
            self.last_hash[request_id] = self.block_hash[hits[-1]] if hits else root  # its chain starts there
            if self.enable_prefix_caching and counted:
                self.num_queried_tokens += queried  # only once granted: a refusal changes nothing
                self.num_hit_tokens += len(hits) * self.block_size
        for b in hits:
            if self.ref_count[b] == 0:
                del self.evictable[b]
            self.ref_count[b] += 1
            table.append(b)
        for _ in range(max(0, needed)):
            table.append(self._take_fresh())
        return Allocation(list(table), len(hits) * self.block_size, copied)

    def holds(self, request_id: str, num_tokens: int) -> bool:
        """It owns blocks for `num_tokens` tokens and writes none of them copy-on-write: growing
        it to `num_tokens` changes nothing (most decodes, inside their last block)."""
        table = self.tables.get(request_id)
        return table is not None and request_id not in self.cow and self.blocks_for(num_tokens) <= len(table)

    def needs_copy(self, request_id: str) -> bool:
        """Its next growth takes a block for copy-on-write."""
        cow = self.cow.get(request_id)
        return cow is not None and self.ref_count[self.tables[request_id][cow]] > 1

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """`child_id` starts as `parent_id`'s first `num_tokens` tokens, computed: it shares
        their blocks. A partly filled last block becomes copy-on-write for both."""
        assert child_id not in self.tables, f"{child_id} already holds blocks"
        table = self.tables[parent_id][: self.blocks_for(num_tokens)]
        assert self.num_hashed[parent_id] <= len(table)
        for b in table:
            self.ref_count[b] += 1
        self.tables[child_id] = list(table)
        self.num_hashed[child_id] = self.num_hashed[parent_id]
        self.last_hash[child_id] = self.last_hash[parent_id]
        if num_tokens % self.block_size:
            self.cow[parent_id] = self.cow[child_id] = num_tokens // self.block_size

    def admit(self, request_id: str, token_ids: list[int] | None, total: int, max_new: int, min_new: int,
              root: bytes | None = None, counted: bool = True) -> tuple[int, int]:
        """Start a request that holds no blocks: look its prefix up among `token_ids` (None =
        no lookup), then take blocks for as many of its next tokens as fit, at most `max_new`
        (and at least `min_new`, else nothing). `total` = tokens it has; `root`: its blocks'
        chain starts there (its cache_salt's); `counted`: its lookup goes into the hit rate (not
        a preempted request's, which finds its own blocks). Returns (num_cached_tokens, num_new_tokens);
        (0, 0) = refused, nothing changed."""
        assert request_id not in self.tables, f"{request_id} is already admitted"
        hits = self._lookup(token_ids, root) if token_ids is not None and self.enable_prefix_caching else []
        cached = len(hits) * self.block_size
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        room = self.num_free_blocks - revived  # fresh blocks we may take
        n = min(max_new, total - cached, (len(hits) + room) * self.block_size - cached)
        if n < max(min(min_new, total - cached), 1):  # all-or-nothing counts what is left after the hits
            return 0, 0
        queried = len(token_ids) if token_ids is not None and counted else 0
        alloc = self._allocate(request_id, cached + n, hits, queried, root, counted)
        assert alloc is not None
        return cached, n

    def _lookup(self, token_ids: list[int], root: bytes | None = None) -> list[int]:
        # Never hit the block holding the last token: it must be computed to get logits.
        hits = []
        for h in prefix_block_hashes(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size, root):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _take_fresh(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(block)]
        self.ref_count[block] = 1
        return block

    def commit(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Record that the first `num_computed` tokens' KV is in the cache: hash the blocks
        that became full so later requests can share them."""
        if not self.enable_prefix_caching or request_id not in self.tables:
            return
        table = self.tables[request_id]
        start = self.num_hashed[request_id]
        parent = self.last_hash[request_id]
        end = min(num_computed // self.block_size, len(table))
        for i in range(start, end):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = table[i]
            if parent not in self.cached and block not in self.block_hash:
                self.cached[parent] = block
                self.block_hash[block] = parent
        self.num_hashed[request_id] = max(start, end)
        self.last_hash[request_id] = parent

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        self.num_hashed.pop(request_id, None)
        self.last_hash.pop(request_id, None)
        self.cow.pop(request_id, None)
        if table is None:
            return
        # Tail first: the LRU then evicts a prefix's tail before its (more shareable) head.
        for block in reversed(table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed twice"
            if self.ref_count[block] == 0:
                if block in self.block_hash:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)

    def check_invariants(self) -> None:
        owned: dict[int, int] = {}
        for table in self.tables.values():
            for b in table:
                owned[b] = owned.get(b, 0) + 1
        for b in range(self.num_blocks):
            assert self.ref_count[b] == owned.get(b, 0), f"block {b}: refcount {self.ref_count[b]} != owners"
        idle = set(self.free_blocks) | set(self.evictable)
        assert len(idle) == len(self.free_blocks) + len(self.evictable), "a block is listed free twice"
        assert idle.isdisjoint(owned), "an owned block is on a free list"
        assert len(idle) + len(owned) == self.num_blocks, "a block is lost"
        for request_id, i in self.cow.items():
            assert request_id in self.tables and i < len(self.tables[request_id]), f"{request_id}: stale copy-on-write"
