"""The executor actor's thread: cancelled mid-step, it does not hold the event loop."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from engine.executor import Executor
from engine.messages import StepPlan


async def test_cancelled_mid_step_the_executor_lets_the_loop_go_on():
    """Its thread was joined on the loop's thread: a stop that timed out and cancelled the
    actor froze the whole loop (HTTP, other engines) until the step ended."""
    entered, release = threading.Event(), threading.Event()

    def hold(plan) -> None:  # the step: runs until released
        entered.set()
        release.wait(30)

    executor = Executor(None, SimpleNamespace(block_size=16), fault_hook=hold)
    actor = asyncio.create_task(executor.run())
    step = asyncio.create_task(executor.execute(StepPlan(step=1, items=[], token_budget=0)))
    assert await asyncio.to_thread(entered.wait, 30)
    timer = threading.Timer(20, release.set)  # the old code's loop came back only once this fired
    timer.start()
    try:
        actor.cancel()
        await asyncio.sleep(0.05)
        assert not release.is_set()  # the loop went on while the step still ran
    finally:
        release.set()
        timer.cancel()
        step.cancel()
    await asyncio.gather(actor, step, return_exceptions=True)
