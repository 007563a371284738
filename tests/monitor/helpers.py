"""Builders and waiting helpers for the monitor tests (no model, no sleeps)."""

from __future__ import annotations

import asyncio
import html
import re

from rich.text import Text

from engine.messages import EngineSnapshot, RequestSnapshot, StepItem, StepRecord
from monitor.source import EngineState
from monitor.widgets import KIND_COLOURS

T0 = 1_700_000_000.0


def record(step: int, items: list[tuple[str, str, int, int]], *, budget: int = 256, duration: float = 0.25,
           ttft: tuple[float, ...] = (), itl: tuple[float, ...] = (), waiting: int = 0, kv: float = 0.1,
           preemptions: int = 0, policy: str = "chunked") -> StepRecord:
    its = [StepItem(*i) for i in items]
    count = {k: sum(i.num_tokens for i in its if i.kind == k) for k in ("prefill", "decode", "padding")}
    return StepRecord(
        step=step, start_time=T0 + step * duration, duration_s=duration, forward_s=duration, policy=policy, token_budget=budget,
        items=its, num_prefill_tokens=count["prefill"], num_decode_tokens=count["decode"],
        num_padding_tokens=count["padding"], num_cached_tokens=0, num_waiting=waiting,
        num_running=len({i.request_id for i in its}), kv_usage=kv, num_preemptions=preemptions,
        ttft_s=list(ttft), itl_s=list(itl),
    )


def decodes(step: int, n: int = 3) -> StepRecord:
    return record(step, [(f"r{i}", "decode", 1, 40 + step) for i in range(n)], itl=tuple(0.1 for _ in range(n)))


def state(step: int = 1, running: list[tuple[str, int, int, int, int]] = ()) -> EngineState:
    """running: (id, prompt, computed, generated, max_tokens)."""
    snap = EngineSnapshot(
        policy="chunked", step=step,
        running=[RequestSnapshot(request_id=i, status="running", num_prompt_tokens=p, num_computed_tokens=c,
                                 num_generated_tokens=g, max_tokens=m, priority=0) for i, p, c, g, m in running],
        waiting=[], kv_usage=0.1, num_blocks=1024, num_free_blocks=900, num_preemptions=0, prefix_cache_hit_rate=0.0,
    )
    return EngineState(snapshot=snap, config={"model": {"model": "test-model"}})


async def until(pilot, predicate, timeout_s: float = 10.0) -> None:
    """Process messages until predicate() holds; fails the test after timeout_s."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await pilot.pause()


def plain(widget) -> str:
    rendered = widget.render()
    return rendered.plain if isinstance(rendered, Text) else str(rendered)


def strip_columns(strip) -> list[list[str | None]]:
    """The strip as columns (oldest first) of kinds, bottom row first, read from what it renders."""
    colour_to_kind = {v: k for k, v in KIND_COLOURS.items()}
    lines = strip.render().split("\n")[:-2]  # the last lines are step durations and the axis
    from monitor.widgets import ZOOM_WIDTHS

    w = ZOOM_WIDTHS[strip.zoom]
    n = len(strip.visible())
    columns: list[list[str | None]] = [[] for _ in range(n)]
    for line in reversed(lines):  # bottom row first
        for c in range(n):
            offset = strip.GUTTER + c * w
            kind = None
            if line.plain[offset : offset + 1] == "█":
                for span in line.spans:
                    if span.start <= offset < span.end:
                        kind = colour_to_kind.get(str(span.style))
            columns[c].append(kind)
    return columns


MIXED_ITEMS = [("long-1", "prefill", 192, 384), ("chat-2", "decode", 1, 40), ("chat-3", "decode", 1, 12),
               ("stale-4", "padding", 4, 0)]


SCREEN_TEXT = re.compile(r'<text [^>]*clip-path="url\(#terminal-\d+-line-(\d+)\)">(.*?)</text>')


def screen_lines(svg: str) -> list[str]:
    """The characters on screen, row by row, read back from a screenshot SVG."""
    rows: dict[int, str] = {}
    for row, chunk in SCREEN_TEXT.findall(svg):
        rows[int(row)] = rows.get(int(row), "") + html.unescape(chunk).replace("\xa0", " ")
    return [rows.get(i, "") for i in range(max(rows, default=-1) + 1)]
