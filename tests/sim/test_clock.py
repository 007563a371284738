from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.sim.clock import Stalled, VirtualLoop, run_virtual


def test_waits_cost_no_wall_time_and_keep_their_order():
    order = []

    async def sleeper(name, s):
        await asyncio.sleep(s)
        order.append((name, asyncio.get_running_loop().time()))

    async def main():
        await asyncio.gather(sleeper("b", 3600.0), sleeper("a", 1.5), sleeper("c", 7200.0))
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 10)
        except TimeoutError:
            pass
        return asyncio.get_running_loop().time()

    wall = time.process_time()
    assert run_virtual(main()) == pytest.approx(7210.0)
    assert time.process_time() - wall < 5  # nowhere near two hours
    assert order == [("a", 1.5), ("b", 3600.0), ("c", 7200.0)]


def test_a_deadlock_is_reported_not_hung():
    async def main():
        await asyncio.Event().wait()

    with pytest.raises(Stalled):
        run_virtual(main())


def test_the_clock_only_moves_when_nothing_is_ready():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(100):
            await asyncio.sleep(0)
        return loop.time() - t0

    assert run_virtual(main()) == 0.0


@pytest.mark.parametrize("start", [0.0, 2e7, 1.7e9, 1e15])
def test_timers_fire_at_any_magnitude_of_time(start):
    """Past ~1.7e7 s, asyncio's `now + 1e-9` is `now`: a timer due exactly now never ran and
    the loop spun at 100 % CPU (a trace of Unix-epoch arrival_s hung engine-sim)."""
    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        loop.call_at(start, fired.append, "due now")
        loop.call_at(start + 1.5, fired.append, "later")
        await asyncio.sleep(2.0)
        return fired, loop.time()

    out = []

    def run():  # on a thread: a loop that spins for ever fails the test instead of hanging it
        loop = VirtualLoop(start)
        try:
            out.append(loop.run_until_complete(main()))
        finally:
            loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert out, "the virtual loop did not finish"
    fired, now = out[0]
    assert fired == ["due now", "later"] and now == pytest.approx(start + 2.0, rel=1e-15, abs=1e-9)
