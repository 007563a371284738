"""One publisher, many async subscribers, none of whom can hold the publisher up.

Each subscriber has a bounded queue; publishing never waits: a slow subscriber loses its
oldest item instead. `close()` ends every subscription, present and later ones. Used for
the engine's step records (Engine.steps) and the HTTP server's /v1/engine/steps feed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()  # queued after the last item: the subscription is over


class Fanout(Generic[T]):
    def __init__(self, buffer: int):
        self.buffer = buffer  # items a subscriber may fall behind before it loses the oldest
        self._queues: set[asyncio.Queue] = set()
        self._closed = False

    def __len__(self) -> int:
        """The number of live subscriptions."""
        return len(self._queues)

    def publish(self, item: T) -> None:
        for q in self._queues:
            self._put(q, item)

    def close(self) -> None:
        self._closed = True
        for q in self._queues:
            self._put(q, _END)

    @contextmanager
    def subscribe(self) -> Iterator[AsyncIterator[T]]:
        """Items published from entry on (registered on entry, so none after it is missed)."""
        q: asyncio.Queue = asyncio.Queue(self.buffer)
        if self._closed:
            q.put_nowait(_END)
        self._queues.add(q)
        try:
            yield self._drain(q)
        finally:
            self._queues.discard(q)

    @staticmethod
    async def _drain(q: asyncio.Queue) -> AsyncIterator[T]:
        while (item := await q.get()) is not _END:
            yield item

    @staticmethod
    def _put(q: asyncio.Queue, item: object) -> None:
        if q.full():
            q.get_nowait()  # the slow subscriber loses its oldest item
        q.put_nowait(item)
