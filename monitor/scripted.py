"""A source driven by a script (tests, screenshots), and a deterministic example history.

    source = ScriptedSource(records, state)   # preloaded: the first connection replays them
    source.push(record)                       # one more step on the open (or next) stream
    source.set_state(state)                   # what state() returns from now on
    source.end() / source.fail(exc)           # the stream ends / breaks, the source goes down
    source.resume()                           # the source is reachable again

While down, `connect()` waits until `resume()` (a server that is not up yet), so a test
sees "disconnected — retrying" without anything spinning.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from engine.messages import EngineSnapshot, FinishedRequest, RequestSnapshot, StepItem, StepRecord
from monitor.source import EngineState, SourceUnavailable, StepSource

_END = object()


class ScriptedSource(StepSource):
    def __init__(
        self,
        records: Iterable[StepRecord] = (),
        state: EngineState | None = None,
        *,
        description: str = "scripted",
        up: bool = True,
    ):
        self.description = description
        self._items: asyncio.Queue = asyncio.Queue()
        for r in records:
            self._items.put_nowait(r)
        self._state = state
        self._up = asyncio.Event()
        if up:
            self._up.set()
        self.connections = 0

    # --- the script ---------------------------------------------------------------------

    def push(self, *records: StepRecord) -> None:
        for r in records:
            self._items.put_nowait(r)

    def set_state(self, state: EngineState | None) -> None:
        self._state = state

    def end(self) -> None:
        """The stream ends cleanly (server shut down); the source stays down until resume()."""
        self._items.put_nowait(_END)

    def fail(self, error: BaseException | None = None) -> None:
        """The stream breaks with `error`; the source stays down until resume()."""
        self._items.put_nowait(error or SourceUnavailable("scripted connection reset"))

    def resume(self) -> None:
        self._up.set()

    # --- StepSource ---------------------------------------------------------------------

    async def connect(self) -> None:
        await self._up.wait()
        self.connections += 1

    async def steps(self) -> AsyncIterator[StepRecord]:
        while True:
            item = await self._items.get()
            if item is _END:
                self._up.clear()
                return
            if isinstance(item, BaseException):
                self._up.clear()
                raise item
            yield item

    async def state(self) -> EngineState | None:
        return self._state


# --- a deterministic example: chunked prefill of a long prompt next to chats -----------------


@dataclass
class _Req:
    rid: str
    prompt: int
    max_tokens: int
    arrival: float
    computed: int = 0
    generated: int = 0
    first_token: float | None = None
    last_token: float | None = None


def example_history(
    num_steps: int = 230,
    *,
    budget: int = 256,
    chunk: int = 192,
    seed: int = 7,
    t0: float = 1_700_000_000.0,
) -> tuple[list[StepRecord], EngineState]:
    """StepRecords and a final snapshot of a small chunked-prefill simulation: chats arrive
    all the time, a 1,500-token prompt arrives every ~20 s and is prefilled in chunks next
    to the running decodes. Same arguments, same history (no clock, fixed seed)."""
    rng = random.Random(seed)
    now = t0
    waiting: list[_Req] = []
    running: list[_Req] = []
    records: list[StepRecord] = []
    next_chat, next_long, n = t0, t0 + 12.0, 0
    preemptions = 0
    num_blocks, block = 1536, 16
    for step in range(1, num_steps + 1):
        while next_chat <= now:
            n += 1
            waiting.append(_Req(f"chat-{n}", rng.randint(24, 140), rng.randint(24, 160), next_chat))
            next_chat += rng.expovariate(2.5)
        if next_long <= now:
            n += 1
            waiting.append(_Req(f"long-{n}", 1500, 48, next_long))
            next_long += 20.0
        left = budget
        plan: list[tuple[_Req, str, int]] = []
        for r in [r for r in running if r.computed >= r.prompt]:
            if left:
                plan.append((r, "decode", 1))
                left -= 1
        for r in [r for r in running if r.computed < r.prompt]:
            if left:
                k = min(r.prompt - r.computed, chunk, left)
                plan.append((r, "prefill", k))
                left -= k
        while left and waiting and len(running) < 64:
            r = waiting.pop(0)
            running.append(r)
            k = min(r.prompt, chunk, left)
            plan.append((r, "prefill", k))
            left -= k
        if not plan:
            now = next_chat
            continue
        tokens = sum(k for _, _, k in plan)
        duration = 0.03 + 0.0017 * tokens + rng.uniform(0, 0.01)
        start, now = now, now + duration
        items, ttft, itl, finished = [], [], [], []
        for r, kind, k in plan:
            pos = r.computed + r.generated if kind == "decode" else r.computed
            items.append(StepItem(r.rid, kind, k, pos))
            if kind == "prefill":
                r.computed += k
                if r.computed < r.prompt:
                    continue
            r.generated += 1
            if r.first_token is None:
                r.first_token = now
                ttft.append(now - r.arrival)
            else:
                itl.append(now - r.last_token)
            r.last_token = now
            if r.generated >= r.max_tokens:
                running.remove(r)
                finished.append(FinishedRequest(r.rid, "length" if rng.random() < 0.6 else "stop", now - r.arrival,
                                                r.prompt, r.generated))
        used_blocks = sum(-(-(r.computed + r.generated) // block) for r in running)
        kinds = {k: sum(it.num_tokens for it in items if it.kind == k) for k in ("prefill", "decode", "padding")}
        records.append(StepRecord(
            step=step, start_time=start, duration_s=duration, forward_s=0.9 * duration, policy="chunked", token_budget=budget, items=items,
            num_prefill_tokens=kinds["prefill"], num_decode_tokens=kinds["decode"], num_padding_tokens=0,
            num_cached_tokens=0, num_waiting=len(waiting), num_running=len(running),
            kv_usage=used_blocks / num_blocks, num_preemptions=preemptions, ttft_s=ttft, itl_s=itl, finished=finished,
        ))

    def snap(r: _Req, status: str) -> RequestSnapshot:
        return RequestSnapshot(request_id=r.rid, status=status, num_prompt_tokens=r.prompt,
                               num_computed_tokens=r.computed + max(r.generated - 1, 0),
                               num_generated_tokens=r.generated, max_tokens=r.max_tokens, priority=0)

    used = sum(-(-(r.computed + r.generated) // block) for r in running)
    snapshot = EngineSnapshot(
        policy="chunked", step=records[-1].step, running=[snap(r, "running") for r in running],
        waiting=[snap(r, "waiting") for r in waiting], kv_usage=used / num_blocks, num_blocks=num_blocks,
        num_free_blocks=num_blocks - used, num_preemptions=preemptions, prefix_cache_hit_rate=0.18,
    )
    config = {"model": {"model": "smollm2-135m"}, "scheduler": {"policy": "chunked", "max_num_batched_tokens": budget,
                                                              "chunk_size": chunk}}
    return records, EngineState(snapshot=snapshot, config=config)
