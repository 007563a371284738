"""Fanout: every subscriber gets every item in order; a slow one loses its oldest items and
never holds the publisher up; close() ends present and later subscriptions."""

from __future__ import annotations

import asyncio

from engine.fanout import Fanout


async def take(records, n: int) -> list:
    return [await anext(records) for _ in range(n)]


async def test_every_subscriber_gets_every_item_from_when_it_subscribed():
    fan: Fanout[int] = Fanout(buffer=8)
    fan.publish(0)  # nobody listens yet: dropped
    with fan.subscribe() as a:
        fan.publish(1)
        with fan.subscribe() as b:
            assert len(fan) == 2
            fan.publish(2)
            assert await take(b, 1) == [2]
        fan.publish(3)
        assert await take(a, 3) == [1, 2, 3]
    assert len(fan) == 0


async def test_a_slow_subscriber_loses_its_oldest_items_and_nobody_waits():
    fan: Fanout[int] = Fanout(buffer=3)
    with fan.subscribe() as slow, fan.subscribe() as fast:
        for i in range(5):
            fan.publish(i)  # never blocks, though `slow` reads nothing
            assert await take(fast, 1) == [i]
        assert await take(slow, 3) == [2, 3, 4]


async def test_close_ends_every_subscription_even_a_full_or_waiting_one_and_later_ones():
    fan: Fanout[int] = Fanout(buffer=2)
    with fan.subscribe() as full, fan.subscribe() as waiting:
        fan.publish(1)
        fan.publish(2)
        assert await take(waiting, 2) == [1, 2]
        next_one = asyncio.ensure_future(anext(waiting, "ended"))
        await asyncio.sleep(0)  # it now waits for a third item
        fan.close()
        assert await next_one == "ended"
        assert [x async for x in full] == [2]  # the oldest made room for the end
    with fan.subscribe() as late:
        assert [x async for x in late] == []
