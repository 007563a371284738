"""Where the dashboard's data comes from.

A `StepSource` is one connection to an engine: `connect()`, then `steps()` (an async
iterator of StepRecords that ends or raises when the connection is lost) and `state()`
(a snapshot of the queues, polled). Three implementations:

    HttpSource     (monitor.http_source)  SSE + JSON from a running `engine-serve`
    EngineSource   (monitor.demo)         an Engine in this process, with a synthetic load
    ScriptedSource (monitor.scripted)     records pushed by a test or a screenshot script

`follow(source)` turns any of them into one stream of events — Connecting, Connected,
StepEvent, StateEvent, Disconnected — reconnecting by itself with exponential backoff.
It never raises for a connection problem: a lost or refused connection is an event with a
human-readable reason, so the UI shows "disconnected — retrying" instead of a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.messages import EngineSnapshot, StepRecord


class SourceUnavailable(Exception):
    """The source cannot be reached or its stream broke; the message says why, for a person."""


class SourceRefused(SourceUnavailable):
    """The source answered, and no retry can change its answer (a replica it does not have)."""


class ReplicaInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One engine replica behind a cluster ingress (`engine-serve --replicas N`)."""

    name: str
    healthy: bool = True
    in_flight: int = 0


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    """What GET /v1/engine/state returns: the snapshot (null while the engine loads) plus
    the server's configuration (EngineConfig.to_dict() sections) and a few facts. Fields
    this monitor does not know are ignored; all but `snapshot` may be missing."""

    snapshot: EngineSnapshot | None
    config: dict[str, dict[str, Any]] = {}
    model: str = ""
    ready: bool = True
    dead: str | None = None
    max_model_len: int | None = None
    replica: str | None = None  # a cluster ingress: the replica these figures are from
    replicas: list[ReplicaInfo] = []  # ... and every replica it has


class StepSource(ABC):
    """One engine to watch. `connect` may be called again after a stream ended."""

    description: str = "?"
    connecting_activity: str = "connecting"  # shown while connect() runs
    replica: str | None = None  # the replica watched, when the source is a cluster ingress

    def select_replica(self, name: str) -> None:
        """Watch this replica from the next connection on (sources of one engine refuse)."""
        raise SourceUnavailable(f"{self.description} has no replicas")

    @abstractmethod
    async def connect(self) -> None:
        """Open the stream; raise SourceUnavailable if it cannot be opened now."""

    @abstractmethod
    def steps(self) -> AsyncIterator[StepRecord]:
        """StepRecords of the open connection; ends (or raises SourceUnavailable) when it is lost."""

    @abstractmethod
    async def state(self) -> EngineState | None:
        """The current snapshot, or None if the source cannot provide one."""

    async def disconnect(self) -> None:
        """Drop the current connection (after its stream ended); `connect` may follow."""

    async def close(self) -> None:
        """Release everything for good."""
        await self.disconnect()


# --- the events follow() produces -----------------------------------------------------------


@dataclass(frozen=True)
class Connecting:
    description: str
    attempt: int  # 0 = the first try since start or since the last successful connection
    activity: str = "connecting"


@dataclass(frozen=True)
class Connected:
    description: str


@dataclass(frozen=True)
class Disconnected:
    description: str
    reason: str
    retry_in_s: float
    attempt: int


@dataclass(frozen=True)
class Refused:
    """The last event: the source refused for good, so `follow` stopped retrying."""

    description: str
    reason: str


@dataclass(frozen=True)
class StepEvent:
    record: StepRecord


@dataclass(frozen=True)
class StateEvent:
    state: EngineState


SourceEvent = Connecting | Connected | Disconnected | Refused | StepEvent | StateEvent


@dataclass
class Backoff:
    """Exponential backoff between reconnection attempts: initial, ×factor, capped."""

    initial_s: float = 0.5
    max_s: float = 5.0
    factor: float = 2.0
    _next: float | None = field(default=None, repr=False)

    def next_delay(self) -> float:
        delay = self.initial_s if self._next is None else self._next
        self._next = min(self.max_s, delay * self.factor)
        return delay

    def reset(self) -> None:
        self._next = None


def describe_error(e: BaseException) -> str:
    """A one-line reason for a person, never a traceback."""
    if isinstance(e, SourceUnavailable):
        return str(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_END = object()


async def follow(
    source: StepSource,
    *,
    state_interval_s: float = 0.5,
    backoff: Backoff | None = None,
) -> AsyncIterator[SourceEvent]:
    """Events from `source`: reconnects with backoff whenever the stream is lost, for ever
    unless the source refuses for good (SourceRefused), which ends with a Refused event.

    Use it with `contextlib.aclosing` so that cancelling the consumer closes the connection.
    """
    backoff = backoff or Backoff()
    attempt = 0
    while True:
        yield Connecting(source.description, attempt, source.connecting_activity)
        try:
            await source.connect()
        except asyncio.CancelledError:
            raise
        except SourceRefused as e:
            yield Refused(source.description, describe_error(e))
            return
        except Exception as e:  # noqa: BLE001 - every failure is a reason to show and retry
            reason = describe_error(e)
        else:
            backoff.reset()
            attempt = 0
            yield Connected(source.description)
            reason = "stream ended"
            async with _pump(source, state_interval_s) as queue:
                while (item := await queue.get()) is not _END:
                    if isinstance(item, BaseException):
                        reason = describe_error(item)
                        break
                    yield item
            with contextlib.suppress(Exception):
                await source.disconnect()
        attempt += 1
        delay = backoff.next_delay()
        yield Disconnected(source.description, reason, delay, attempt)
        await asyncio.sleep(delay)


@contextlib.asynccontextmanager
async def _pump(source: StepSource, state_interval_s: float) -> AsyncIterator[asyncio.Queue]:
    """Run the step reader and the state poller as tasks feeding one queue; an exception or
    the end of the step stream arrives in the queue as the exception itself or _END."""
    queue: asyncio.Queue = asyncio.Queue()

    async def read_steps() -> None:
        try:
            async with contextlib.aclosing(source.steps()) as records:
                async for record in records:
                    queue.put_nowait(StepEvent(record))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            queue.put_nowait(e)
        queue.put_nowait(_END)

    async def poll_state() -> None:
        last = None
        while True:
            try:
                state = await source.state()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a dead state endpoint means a dead server
                queue.put_nowait(e)
                return
            if state is not None and state != last:
                last = state
                queue.put_nowait(StateEvent(state))
            await asyncio.sleep(state_interval_s)

    tasks = [asyncio.create_task(read_steps(), name="monitor-steps"),
             asyncio.create_task(poll_state(), name="monitor-state")]
    try:
        yield queue
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
