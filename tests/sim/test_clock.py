from __future__ import annotations

import asyncio
import time

import pytest

from engine.sim.clock import Stalled, run_virtual


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
