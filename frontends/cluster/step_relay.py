"""One step stream per replica, shared by every /v1/engine/steps client of the ingress.

Each client used to open its own streaming Ray call on the replica. Every call holds one of
the replica's `max_ongoing_requests` slots, which its generations and its health probe share,
so enough watchers made a healthy replica look dead: the probe queued behind them, timed
out, and the replica's generations were cut. Now the first watcher of a replica opens its
stream, the others share it through a `Fanout` (a slow one loses its oldest records, as on
the single server), and the last to leave closes it. It also ends when the replica ends it,
fails or is marked down (a hung one's would wait for ever), and at shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from engine.fanout import Fanout
from frontends.cluster.cluster_engine import ClusterEngine, unless
from frontends.http.feed import SUBSCRIBER_BUFFER


class StepRelay:
    def __init__(self, cluster: ClusterEngine):
        self.cluster = cluster
        self._feeds: dict[str, tuple[Fanout, asyncio.Task]] = {}  # replica -> its watchers, its reader
        self._closed = False

    def streams(self) -> int:
        """Step streams open on the replicas (one per watched replica)."""
        return len(self._feeds)

    @contextmanager
    def subscribe(self, name: str) -> Iterator[AsyncIterator[object]]:
        """Replica `name`'s step records from now on, until it or the relay ends them."""
        feed = self._feeds.get(name)
        if feed is None:
            fanout: Fanout[object] = Fanout(SUBSCRIBER_BUFFER)
            if self._closed:
                fanout.close()
                feed = (fanout, None)
            else:  # the reader starts after our subscription below: it misses nothing for us
                feed = self._feeds[name] = (fanout, asyncio.create_task(self._read(name, fanout)))
        fanout, reader = feed
        try:
            with fanout.subscribe() as records:
                yield records
        finally:
            if not len(fanout) and self._feeds.get(name) is feed:  # the last watcher left
                del self._feeds[name]
                reader.cancel()

    def close(self) -> None:
        """End every stream (shutdown): watchers' responses finish, later ones end at once."""
        self._closed = True
        for fanout, reader in self._feeds.values():
            fanout.close()
            reader.cancel()
        self._feeds.clear()

    async def _read(self, name: str, fanout: Fanout[object]) -> None:
        records = None
        try:
            records = self.cluster.handles[name].options(stream=True).steps.remote()
            while True:
                fanout.publish(await unless(records.__anext__(), self.cluster.went_down(name)))
        except Exception:  # noqa: BLE001 - Ray's own error opening it, StopAsyncIteration, the replica's, ReplicaGone
            pass
        finally:
            if records is not None:
                records.cancel()
            fanout.close()
            if self._feeds.get(name, (None,))[0] is fanout:  # the next watcher opens a fresh stream
                del self._feeds[name]
