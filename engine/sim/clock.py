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
import math
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

    # asyncio runs a timer once `when < time() + _clock_resolution`. Its 1e-9 s is lost in a
    # clock past ~1.7e7 s (a double's spacing there is 3.7e-9 s): a timer due exactly now
    # would never run, and select(0) does not move the clock, so the loop spun for ever. One
    # step of the clock's own spacing, at least asyncio's 1e-9 s, is "now" at any magnitude.
    @property
    def _clock_resolution(self) -> float:
        return max(1e-9, math.ulp(self.clock.now))

    @_clock_resolution.setter
    def _clock_resolution(self, _: float) -> None:
        pass  # BaseEventLoop.__init__ sets the real clock's


def run_virtual(coro):
    """Run `coro` to completion on a fresh virtual-time loop; returns its result."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
