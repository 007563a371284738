"""The KV block manager actor: the only owner of the BlockPool.

The scheduler sends it one `KVStep` per step — everything that step changes in the cache:
commits of newly computed blocks, forks (n > 1: a choice starts from its group's prefilled
prompt), frees of requests that left, growths of running requests and admissions of new
ones — and gets one `KVGrant` back: the block tables, what each admission got (prefix-cache
hits found here), the growths refused, the block copies the executor must make before the
step (copy-on-write of a forked partial block), and the pool's figures.
Order inside a step: commits, forks, frees, growths (most important request first), admissions.
Once a growth is refused, no later growth takes a new block and no admission is granted: the
blocks there are go to the more important requests.

Tables in a grant are the pool's own lists, not copies: the scheduler and the executor read
them only until the scheduler's next message, and the pool changes a table only while it
handles a message — so nobody reads a table while it changes.
"""

from __future__ import annotations

import asyncio

import msgspec

from engine.block_hash import salted_root
from engine.block_pool import BlockPool


class Admit(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_ids: list[int]  # all the request's tokens (prompt, and outputs after a preemption)
    lookup: bool  # look the prefix up in the cache
    max_new_tokens: int
    min_new_tokens: int  # all-or-nothing policies ask for every token at once
    cache_salt: str | None = None  # shares blocks only with requests of the same salt
    counted: bool = True  # in the hit rate: False for a preempted request finding its own blocks again


class KVStep(msgspec.Struct, tag=True):
    commits: list[tuple[str, list[int], int]]  # (request id, token ids, num computed): blocks it filled
    frees: list[str]
    grows: list[tuple[str, int]]  # (request id, tokens to hold in all), most important first
    admits: list[Admit]
    forks: list[tuple[str, str, int]] = []  # (parent id, child id, tokens shared)
    reply: asyncio.Future | None = None  # -> KVGrant (set by the client when it sends the step)


class Stop(msgspec.Struct, tag=True):
    pass


BlockMsg = KVStep | Stop


class KVFigures(msgspec.Struct, frozen=True):
    num_blocks: int
    num_free_blocks: int
    usage: float
    hit_rate: float
    num_owners: int


class Admitted(msgspec.Struct, frozen=True, array_like=True):
    num_cached_tokens: int
    num_new_tokens: int  # 0: refused (no room), nothing taken


class KVGrant(msgspec.Struct, frozen=True):
    tables: dict[str, list[int]]  # every grown or admitted request's table (read-only, see above)
    admitted: dict[str, Admitted]
    refused: list[str]  # growths the pool could not supply
    figures: KVFigures
    copies: list[tuple[int, int]] = []  # (src, dst) blocks: copy src's KV to dst before the step writes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self._pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.inbox: asyncio.Queue[BlockMsg] = asyncio.Queue()
        self.figures = self._figures()
        self.num_messages = 0  # KVSteps handled (examples/profile_step.py counts them per step)

    @property
    def block_size(self) -> int:
        return self._pool.block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    def _figures(self) -> KVFigures:
        p = self._pool
        return KVFigures(p.num_blocks, p.num_free_blocks, p.usage, p.hit_rate, len(p.tables))

    async def run(self) -> None:
        while True:
            match await self.inbox.get():
                case KVStep() as step:
                    grant = self.apply(step)
                    if not step.reply.done():
                        step.reply.set_result(grant)
                case Stop():
                    return

    def apply(self, step: KVStep) -> KVGrant:
        self.num_messages += 1
        pool = self._pool
        for request_id, token_ids, num_computed in step.commits:
            pool.commit(request_id, token_ids, num_computed)
        tables, refused, admitted, copies = {}, [], {}, []
        for parent_id, child_id, num_tokens in step.forks:
            pool.fork(parent_id, child_id, num_tokens)
            tables[child_id] = pool.tables[child_id]
        for request_id in step.frees:
            pool.free(request_id)
            tables.pop(request_id, None)
        dry = False  # once a growth needing blocks is refused, no less important one takes any
        for request_id, num_tokens in step.grows:
            if pool.holds(request_id, num_tokens):  # granted as it is, dry or not
                tables[request_id] = pool.tables[request_id]
                continue
            table = pool.tables.get(request_id, [])
            needs = pool.blocks_for(num_tokens) > len(table) or pool.needs_copy(request_id)
            if dry and needs or (alloc := pool.allocate(request_id, num_tokens)) is None:
                dry = True
                refused.append(request_id)
            else:
                tables[request_id] = pool.tables[request_id]
                if alloc.copied is not None:
                    copies.append(alloc.copied)
        for a in step.admits:
            if dry:  # a running request is short of blocks: no newcomer takes any
                admitted[a.request_id] = Admitted(0, 0)
                continue
            cached, new = pool.admit(a.request_id, a.token_ids if a.lookup else None, len(a.token_ids),
                                     a.max_new_tokens, a.min_new_tokens, salted_root(a.cache_salt), a.counted)
            admitted[a.request_id] = Admitted(cached, new)
            if new:
                tables[a.request_id] = pool.tables[a.request_id]
        self.figures = self._figures()
        return KVGrant(tables, admitted, refused, self.figures, copies)

    def check_invariants(self) -> None:
        """For tests: the pool's own consistency checks."""
        self._pool.check_invariants()


class BlockManagerClient:
    """The scheduler's handle: one message per step, never touches the pool."""

    def __init__(self, manager: BlockManager):
        self._inbox = manager.inbox
        self._manager = manager

    @property
    def figures(self) -> KVFigures:
        """The figures published after the last message (a value, safe to read any time)."""
        return self._manager.figures

    async def step(self, step: KVStep) -> KVGrant:
        step.reply = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(step)
        return await step.reply
