"""The registry of live handlers (generations and step streams), so shutdown can end them.

Shutdown may first `drain`: from then on new generations are refused (503, and /health
says so) while the ones in flight get up to the grace period to finish on their own. Then it
aborts every tracked engine request — each handler then sees its final output
(finish_reason "abort") and ends its response properly: an SSE error event and [DONE], or
a 503 (also when the request was still waiting for its grammar: its submit raises
RequestAbortedError) — and waits for the handlers; any still running after `timeout` are
cancelled. A handler is tracked with every engine request it generates (a batch of prompts
has one per prompt).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from engine import Engine


class LiveRequests:
    def __init__(self) -> None:
        self._live: dict[asyncio.Task, tuple[str, ...]] = {}  # handler task -> its engine request ids
        self.closing = False

    def __len__(self) -> int:
        return len(self._live)

    @contextmanager
    def track(self, *request_ids: str) -> Iterator[None]:
        """The current handler, with the engine requests it generates (none: a step stream)."""
        task = asyncio.current_task()
        assert task is not None
        self._live[task] = request_ids
        try:
            yield
        finally:
            self._live.pop(task, None)

    @property
    def num_generations(self) -> int:
        return sum(bool(request_ids) for request_ids in self._live.values())

    async def drain(self, timeout: float) -> None:
        """Refuse new work from now on; wait up to `timeout` for in-flight generations to end."""
        self.closing = True
        generations = [task for task, request_ids in self._live.items() if request_ids]
        if generations and timeout > 0:
            await asyncio.wait(generations, timeout=timeout)

    async def close_all(self, engine: Engine, timeout: float) -> None:
        self.closing = True
        for request_ids in list(self._live.values()):
            for request_id in request_ids:
                await engine.abort(request_id)
        tasks = list(self._live)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
