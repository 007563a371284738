"""An asyncio event loop on a virtual clock: waiting costs no wall time.

The engine's actors are asyncio tasks that wait on queues, futures and timeouts. Run them on
this loop and every wait that would sleep (`asyncio.sleep`, `wait_for` timeouts, `call_at`)
instead moves the clock straight to the next scheduled callback. Everything else about the
loop is asyncio's own, so the scheduler's `run()` executes exactly as it does in the engine.

Invariant: the clock never goes back, and it moves only when no callback is ready (all
work due "now" runs before time advances). With nothing ready and nothing scheduled, every
task waits on something no one will ever send: `Stalled` is raised rather than hanging.
"""

from __future__ import annotations

import asyncio
import selectors


class Stalled(RuntimeError):
    """The simulation can make no progress: every task waits and no timer is set."""


class _VirtualSelector(selectors.DefaultSelector):
    """Polls real file descriptors without blocking (the loop's self-pipe); a wait of
    `timeout` seconds advances the virtual clock instead of blocking."""

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self._clock = clock

    def select(self, timeout=None):
        if timeout == 0:
            return []  # callbacks are ready; real fds are polled before the clock next moves
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise Stalled("every task is waiting and no timer is set")
        self._clock.advance(timeout)
        return []


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the clock cannot go back ({seconds} s)")
        self.now += seconds


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        self.clock = VirtualClock(start)
        super().__init__(_VirtualSelector(self.clock))

    def time(self) -> float:
        return self.clock.now


def run_virtual(coro):
    """Run `coro` to completion on a fresh virtual-time loop; returns its result."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
