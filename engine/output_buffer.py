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

A request with n > 1 choices has one buffer for all of them: outputs carry their choice's
`index`, a delta is only ever merged into an earlier output of the same choice, and the
request ends once every choice has put its final output (`has_final`) — at most
`max_pending + num_choices` outputs wait then.

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
    """Single producer (the scheduler, `put_nowait`), single reader (`get`, until `is_done`)."""

    def __init__(self, max_pending: int = MAX_PENDING_OUTPUTS, on_final: Callable[[], None] | None = None,
                 num_choices: int = 1):
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if num_choices < 1:
            raise ValueError("num_choices must be >= 1")
        self.max_pending = max_pending
        self.on_final = on_final
        self.num_choices = num_choices
        self._ended: set[int] = set()  # choices whose final output was put (nothing of theirs may follow)
        self._num_finals_taken = 0
        self._abandoned = False
        self.has_reader = False  # set by Engine.stream: a second reader is refused
        self._items: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future | None = None
        self.num_coalesced = 0  # outputs merged into an earlier one
        self.high_water = 0  # most outputs ever waiting at once

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    @property
    def has_final(self) -> bool:
        """Every choice's final output was put (nothing may follow)."""
        return len(self._ended) >= self.num_choices

    @property
    def is_done(self) -> bool:
        """Every choice's final output was taken: the reader has read the whole request."""
        return self._num_finals_taken >= self.num_choices

    def open_choices(self) -> list[int]:
        """Choices whose final output has not been put yet."""
        return [i for i in range(self.num_choices) if i not in self._ended]

    def put_nowait(self, out: RequestOutput) -> None:
        if out.index in self._ended or self.has_final:
            return  # the choice already ended (e.g. failed by a dying engine): one end only
        if out.finished:
            self._ended.add(out.index)
        items = self._items
        same = self._newest_of(out.index) if len(items) >= self.max_pending else None
        if same is not None and not items[same].finished:
            items[same] = merge(items[same], out)
            self.num_coalesced += 1
        else:
            items.append(out)
            self.high_water = max(self.high_water, len(items))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.has_final and self._abandoned:
            self._fire()

    def _newest_of(self, index: int) -> int | None:
        """Position of the newest waiting output of choice `index`."""
        items = self._items
        for i in range(len(items) - 1, -1, -1):
            if items[i].index == index:
                return i
        return None

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
            self._num_finals_taken += 1
            if self.is_done:
                self._fire()
        return out

    def _fire(self) -> None:
        callback, self.on_final = self.on_final, None
        if callback is not None:
            callback()
