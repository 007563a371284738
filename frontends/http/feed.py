"""One consumer of `engine.steps()` per app: feeds the metrics and fans records out to the
/v1/engine/steps subscribers.

A slow subscriber loses its oldest records rather than holding anyone up; `close()` ends
every subscription (at shutdown) while the metrics keep being fed until the app's cleanup.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager

from engine import Engine, StepRecord
from engine.fanout import Fanout
from frontends.http.metrics import Metrics

SUBSCRIBER_BUFFER = 1024


class StepFeed:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._fanout: Fanout[StepRecord] = Fanout(SUBSCRIBER_BUFFER)

    async def run(self) -> None:
        async for record in self.engine.steps():
            self.metrics.observe(record)
            self._fanout.publish(record)
        self.close()  # the engine stopped

    def subscribe(self) -> AbstractContextManager[AsyncIterator[StepRecord]]:
        """Records from now on (registered on entry, so none is missed after it)."""
        return self._fanout.subscribe()

    def close(self) -> None:
        self._fanout.close()
