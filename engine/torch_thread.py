"""The one thread that runs an engine's torch work, and threads that run torch and then exit.

On Linux torch's intra-op threads are libgomp's (OpenMP). libgomp keeps a pool of worker
threads for every thread that ever ran a parallel region, for as long as that thread lives.
Once all pools together hold more threads than the machine has cores, its workers stop
spinning between parallel regions and each region wakes them through the kernel instead. A
decode step runs ~150 parallel regions, microseconds apart: on a 2-core machine a 1-row
step of the default model went from ~11 ms to 25-40 ms as soon as a second thread that had
run one torch matmul was alive (an idle asyncio.to_thread worker was enough).

So an engine loads, builds, calibrates and steps its model on one thread (`torch_thread`),
and code that needs torch on another thread for a while (a benchmark loading a model to
share between engines, a peer) runs it on a thread that exits afterwards
(`in_passing_thread`), which takes its pool with it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def torch_thread() -> ThreadPoolExecutor:
    """A single worker thread for all of one engine's torch work."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepwise-step")


async def in_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread that ends when fn returns (its OpenMP pool ends with it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def body() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed (its program ended mid-call): nobody waits
            pass

    thread = threading.Thread(target=body, name="stepwise-passing", daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():  # fn has returned or raised: only the thread's exit is left
            thread.join()
