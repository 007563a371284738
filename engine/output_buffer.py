"""A request's outputs on their way from the scheduler to its reader: a bounded buffer.

The scheduler puts one RequestOutput per step and must never wait; the reader (`Engine.stream`,
e.g. an HTTP handler writing to a client) takes them. A reader that falls behind — a client
reading its stream slowly holds its handler in `write` — must cost neither the engine nor
the other streams anything, and must not make memory grow with every step it misses.

Behaviour: **coalesce, never drop, never block.** While fewer than `max_pending` outputs
wait, each step's delta is queued as it is (a reader that keeps up sees one output per
step). When `max_pending` are waiting, a new output is merged into the newest waiting one:
their `text` and `token_ids` are concatenated and the counters (generated tokens, cached
tokens) and, for a final output, `finished` / `finish_reason` / `error` are the newer
output's. So:

- at most `max_pending` outputs wait per request, however far the reader falls behind (a
  reader stalled for a thousand steps holds `max_pending` objects, not a thousand);
- the text waiting is at most what the request generated, which is bounded by its
  `max_tokens` (and the request holds those token ids anyway);
- the reader loses nothing: the concatenation of what it reads is exactly what it would
  have read had it kept up, only in fewer, larger deltas, and the final output still comes
  last, exactly once.

`num_coalesced` and `high_water` are kept for tests and observation. `on_final` is called once,
when the final output is taken — or, once the reader `abandon`s the request (it aborted), as
soon as the final output is put: the engine then forgets the request, however it was read.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # engine.messages imports engine.request, which imports this module
    from engine.messages import RequestOutput

MAX_PENDING_OUTPUTS = 16


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output carrying both deltas; everything else (including the end) from `newer`."""
    logprobs = newer.logprobs if older.logprobs is None else older.logprobs + (newer.logprobs or [])
    return msgspec.structs.replace(newer, text=older.text + newer.text, token_ids=older.token_ids + newer.token_ids,
                                   logprobs=logprobs, prompt_logprobs=older.prompt_logprobs or newer.prompt_logprobs)


class OutputBuffer:
    """Single producer (the scheduler, `put_nowait`), single reader (`get`)."""

    def __init__(self, max_pending: int = MAX_PENDING_OUTPUTS, on_final: Callable[[], None] | None = None):
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.max_pending = max_pending
        self.on_final = on_final
        self.has_final = False  # a final output was put (nothing may follow it)
        self._abandoned = False
        self._items: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future | None = None
        self.num_coalesced = 0  # outputs merged into an earlier one
        self.high_water = 0  # most outputs ever waiting at once

    def __len__(self) -> int:
        return len(self._items)

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, out: RequestOutput) -> None:
        if self.has_final:
            return  # the request already ended (e.g. failed by a dying engine): one end only
        self.has_final = out.finished
        items = self._items
        if len(items) >= self.max_pending and not items[-1].finished:
            items[-1] = merge(items[-1], out)
            self.num_coalesced += 1
        else:
            items.append(out)
            self.high_water = max(self.high_water, len(items))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if out.finished and self._abandoned:
            self._fire()

    def abandon(self) -> None:
        """The reader aborted the request: forget it when it ends, whether or not its final
        output is ever read (a stream already reading still gets it)."""
        self._abandoned = True
        if self.has_final:
            self._fire()

    def get_nowait(self) -> RequestOutput:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._taken(self._items.popleft())

    async def get(self) -> RequestOutput:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._taken(self._items.popleft())

    def _taken(self, out: RequestOutput) -> RequestOutput:
        if out.finished:
            self._fire()
        return out

    def _fire(self) -> None:
        callback, self.on_final = self.on_final, None
        if callback is not None:
            callback()
