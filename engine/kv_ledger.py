"""The scheduler's ledger of KV capacity: what it plans a step against, and the step's changes.

The block manager owns the blocks; the scheduler keeps this local estimate so a policy can
plan a whole step without a round trip: free blocks as of the last grant, blocks each
request holds, and the changes of the step being planned (commits, frees, growths,
admissions), sent as one `KVStep`. The estimate is exact for growths; an admission is
counted as its new tokens alone, while prefix hits are found by the pool: a hit on blocks in
use costs nothing, but one revived from the evictable cache takes a free block, and the new
tokens come after the hit — so a later admission of the same step may get fewer tokens than
planned, or none. A free counts all of a request's blocks although shared prefix blocks stay
taken, so a growth may still be refused. The grant says what each got, and the scheduler
preempts the refused. A fork (n > 1) takes no block and is counted as holding its parent's;
its first growth, and its parent's, is counted one block more for the copy-on-write of a
shared partial block (safe: the last sharer copies nothing). The grant lists the block
copies the pool decided; the scheduler hands them to the executor with the next plan
(`take_copies`).
"""

from __future__ import annotations

from engine.block_manager import Admit, KVGrant, KVStep


class KVLedger:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free_blocks = num_blocks  # estimate, corrected by every grant
        self.held: dict[str, int] = {}  # request id -> blocks it holds (or will, once granted)
        self.tables: dict[str, list[int]] = {}  # as granted: the pool's lists, read-only
        self._commits: list[tuple[str, list[int], int]] = []
        self._frees: list[str] = []
        # request id -> (tokens to hold, blocks held before); insertion order = importance
        self._grows: dict[str, tuple[int, int]] = {}
        self._admits: list[Admit] = []
        self._forks: list[tuple[str, str, int]] = []
        self._before: dict[str, int] = {}  # blocks held before the growths of the last message
        self._cow: set[str] = set()  # forked requests whose next growth may copy a block
        self._copies: list[tuple[int, int]] = []  # granted copies not yet handed to the executor

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_blocks

    # --- planning -------------------------------------------------------------------------

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Plan for a running request to hold `num_tokens` tokens. False: no room."""
        held = self.held.get(request_id, 0)
        need = self.blocks_for(num_tokens) - held + (request_id in self._cow)
        if need <= 0:
            return True  # inside the blocks it holds (most decodes): the pool has nothing to do
        if need > self.num_free_blocks:
            return False
        self.num_free_blocks -= need
        self.held[request_id] = held + need
        self._grows[request_id] = (num_tokens, self._grows.get(request_id, (0, held))[1])
        return True

    def admit(self, request_id: str, token_ids: list[int], lookup: bool, max_new: int, min_new: int,
              cache_salt: str | None = None, counted: bool = True) -> int:
        """Plan to start a request with up to `max_new` tokens (at least `min_new`), assuming no
        prefix hit. Returns the tokens planned, 0 = no room."""
        n = min(max_new, self.num_free_blocks * self.block_size)
        if n < max(min_new, 1):
            return 0
        self.num_free_blocks -= self.blocks_for(n)
        self.held[request_id] = self.blocks_for(n)
        self._admits.append(Admit(request_id, token_ids, lookup, max_new, min_new, cache_salt, counted))
        return n

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """`child_id` shares `parent_id`'s blocks of its first `num_tokens` (computed) tokens."""
        self.held[child_id] = self.blocks_for(num_tokens)
        self._forks.append((parent_id, child_id, num_tokens))
        if num_tokens % self.block_size:
            self._cow.update((parent_id, child_id))

    def free(self, request_id: str) -> None:
        """The request leaves: its blocks go back (sent with the next step's message)."""
        self._cow.discard(request_id)
        if request_id in self.held:
            self.num_free_blocks += self.held.pop(request_id)
            self.tables.pop(request_id, None)
            self._grows.pop(request_id, None)
            self._frees.append(request_id)

    def commit(self, items: list[tuple[str, list[int], int]]) -> None:
        self._commits.extend(items)

    # --- the step's message ---------------------------------------------------------------

    @property
    def has_changes(self) -> bool:
        return bool(self._commits or self._frees or self._grows or self._admits or self._forks)

    def take(self) -> KVStep:
        step = KVStep(self._commits, self._frees, [(r, n) for r, (n, _) in self._grows.items()], self._admits,
                      self._forks)
        self._before = {r: held for r, (_, held) in self._grows.items()}
        self._commits, self._frees, self._grows, self._admits, self._forks = [], [], {}, [], []
        return step

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies granted so far: the next plan's executor makes them before its forward."""
        copies, self._copies = self._copies, []
        return copies

    def apply(self, grant: KVGrant) -> None:
        for request_id in grant.refused:
            self.held[request_id] = self._before[request_id]  # the pool kept what it had
        for request_id, table in grant.tables.items():
            self.tables[request_id] = table
            self.held[request_id] = len(table)
            if request_id in self._before:
                self._cow.discard(request_id)  # it grew: any copy it needed is made
        self._copies.extend(grant.copies)
        for request_id, got in grant.admitted.items():
            if not got.num_new_tokens:
                self.held.pop(request_id, None)
        self.num_free_blocks = grant.figures.num_free_blocks
