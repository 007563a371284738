"""The KV block manager actor: the only owner of the BlockPool.

The scheduler talks to it through `BlockManagerClient`: `allocate` awaits an answer (a block
table, or None = cannot allocate, and the scheduler decides whom to preempt); `commit` and
`free` are one-way messages. The inbox is FIFO, so a free sent before an allocate is applied
first. Figures (usage, hit rate) are published after every message for snapshots.
"""

from __future__ import annotations

import asyncio

import msgspec

from engine.block_pool import Allocation, BlockPool


class Allocate(msgspec.Struct, tag=True):
    request_id: str
    num_tokens: int
    token_ids: list[int] | None
    reply: asyncio.Future


class Commit(msgspec.Struct, tag=True):
    items: list[tuple[str, list[int], int]]  # (request id, token ids, num computed)


class Free(msgspec.Struct, tag=True):
    request_id: str


class Sync(msgspec.Struct, tag=True):
    reply: asyncio.Future  # -> KVFigures once every earlier message is applied


class Stop(msgspec.Struct, tag=True):
    pass


BlockMsg = Allocate | Commit | Free | Sync | Stop


class KVFigures(msgspec.Struct, frozen=True):
    num_blocks: int
    num_free_blocks: int
    usage: float
    hit_rate: float
    num_owners: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self._pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.inbox: asyncio.Queue[BlockMsg] = asyncio.Queue()
        self.figures = self._figures()

    def _figures(self) -> KVFigures:
        p = self._pool
        return KVFigures(p.num_blocks, p.num_free_blocks, p.usage, p.hit_rate, len(p.tables))

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case Allocate(request_id, num_tokens, token_ids, reply):
                    result = self._pool.allocate(request_id, num_tokens, token_ids)
                    if not reply.done():
                        reply.set_result(result)
                case Commit(items):
                    for request_id, token_ids, num_computed in items:
                        self._pool.commit(request_id, token_ids, num_computed)
                case Free(request_id):
                    self._pool.free(request_id)
                case Sync(reply):
                    if not reply.done():
                        reply.set_result(self._figures())
                case Stop():
                    return
            self.figures = self._figures()

    def check_invariants(self) -> None:
        """For tests: the pool's own consistency checks."""
        self._pool.check_invariants()


class BlockManagerClient:
    """The scheduler's handle: sends messages, never touches the pool."""

    def __init__(self, manager: BlockManager):
        self._inbox = manager.inbox
        self._manager = manager
        self.block_size = manager._pool.block_size
        self.num_blocks = manager._pool.num_blocks

    @property
    def figures(self) -> KVFigures:
        return self._manager.figures

    async def allocate(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None) -> Allocation | None:
        reply = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(Allocate(request_id, num_tokens, token_ids, reply))
        return await reply

    def commit(self, items: list[tuple[str, list[int], int]]) -> None:
        if items:
            self._inbox.put_nowait(Commit(items))

    def free(self, request_id: str) -> None:
        self._inbox.put_nowait(Free(request_id))

    async def sync(self) -> KVFigures:
        reply = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(Sync(reply))
        return await reply

    def stop(self) -> None:
        self._inbox.put_nowait(Stop())
