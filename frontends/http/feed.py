"""One consumer of `engine.steps()` per app: feeds the metrics and fans records out to the
/v1/engine/steps subscribers.

A slow subscriber loses its oldest records rather than holding anyone up; `close()` ends
every subscription (at shutdown) while the metrics keep being fed until the app's cleanup.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from engine import Engine, StepRecord
from frontends.http.metrics import Metrics

SUBSCRIBER_BUFFER = 1024


class StepFeed:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._subscribers: set[asyncio.Queue[StepRecord | None]] = set()
        self._closed = False

    async def run(self) -> None:
        async for record in self.engine.steps():
            self.metrics.observe(record)
            for q in self._subscribers:
                if q.full():
                    q.get_nowait()
                q.put_nowait(record)
        self.close()  # the engine stopped

    @contextmanager
    def subscribe(self) -> Iterator[AsyncIterator[StepRecord]]:
        """Records from now on (registered on entry, so none is missed after it)."""
        q: asyncio.Queue[StepRecord | None] = asyncio.Queue(SUBSCRIBER_BUFFER)
        if self._closed:
            q.put_nowait(None)
        self._subscribers.add(q)
        try:
            yield self._drain(q)
        finally:
            self._subscribers.discard(q)

    @staticmethod
    async def _drain(q: asyncio.Queue[StepRecord | None]) -> AsyncIterator[StepRecord]:
        while (record := await q.get()) is not None:
            yield record

    def close(self) -> None:
        self._closed = True
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
            q.put_nowait(None)
