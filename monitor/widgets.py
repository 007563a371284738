"""The dashboard's widgets. Each one is handed its data as reactive attributes by the App
and only draws; none of them reads the source or the MonitorState."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Label, Sparkline

from engine.messages import EngineSnapshot, RequestSnapshot, StepItem, StepRecord
from monitor.state import LatencyView, QueueView, StatusView

KIND_COLOURS = {"decode": "#4fd18b", "prefill": "#4aa3ff", "padding": "#e5904f"}
STACK_ORDER = ("decode", "prefill", "padding")  # bottom to top in the strip
EMPTY = "#3a3f4b"
DIM = "#8a90a0"
DURATION = "#b48ead"
BARS = " ▁▂▃▄▅▆▇█"
ZOOM_WIDTHS = (1, 2, 3, 4, 6, 8)  # cells per step in the strip
DEFAULT_ZOOM = 1


def _n(x: int) -> str:
    return f"{x:,}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.2f} s"


def bar(width: int, parts: list[tuple[float, str]], total: float, empty: str = EMPTY) -> Text:
    """A horizontal bar `width` cells wide: coloured parts (value, colour) out of `total`."""
    text = Text()
    if width <= 0:
        return text
    total = max(total, sum(v for v, _ in parts), 1e-9)
    used, acc = 0, 0.0
    for value, colour in parts:
        acc += value
        end = min(width, round(acc / total * width))
        if value > 0 and end <= used and used < width:
            end = used + 1  # anything non-zero gets at least one cell
        if end > used:
            text.append("█" * (end - used), style=colour)
            used = end
    if used < width:
        text.append("░" * (width - used), style=empty)
    return text


def progress_cell(done: int, total: int, colour: str, width: int = 12) -> Text:
    text = bar(width, [(done, colour)], max(total, 1))
    text.append(f" {_n(done)}/{_n(total)}")
    return text


# --- status line ------------------------------------------------------------------------


class StatusBar(Widget):
    """One line: where the data comes from, the connection state, paused or live."""

    status: reactive[StatusView] = reactive(StatusView("connecting", ""))
    paused: reactive[bool] = reactive(False)
    engine: reactive[str] = reactive("")  # "chunked · smollm2-135m"

    def watch_status(self, status: StatusView) -> None:
        for kind in ("connecting", "connected", "disconnected", "refused"):
            self.set_class(status.kind == kind, f"-{kind}")

    def watch_paused(self, paused: bool) -> None:
        self.set_class(paused, "-paused")

    def render(self) -> Text:
        """The connection state (and paused) first, so a narrow terminal or a long model path
        never pushes them off the line; where the data comes from after them."""
        s = self.status
        text = Text(" ")
        if s.kind == "connected":
            text.append("● live", style="bold")
        elif s.kind == "connecting":
            text.append(f"◌ {s.activity}…", style="bold")
        elif s.kind == "refused":
            text.append("✕ refused — not retrying (q quits)", style="bold")
            text.append(f" · {s.reason}")
        else:
            retry = f"retrying in {s.retry_in_s:.1f} s" if s.retry_in_s else f"retrying (attempt {s.attempt})"
            text.append(f"○ disconnected — {retry}", style="bold")
            if s.reason:
                text.append(f" · {s.reason}")
        if self.paused:
            text.append("  ⏸ PAUSED (p to resume)", style="bold reverse")
        text.append(" │ ", style=DIM)
        text.append("Stepwise monitor ", style="bold")
        text.append("│ ", style=DIM)
        text.append(s.description or "…")
        if self.engine:
            text.append(" │ ", style=DIM)
            text.append(self.engine)
        return text


# --- current step -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepView:
    record: StepRecord
    prompt_lengths: dict[str, int]  # request id -> prompt length, for "pos … of N"


class StepPanel(Widget):
    """The latest step: number, duration, budget use and every request in it."""

    view: reactive[StepView | None] = reactive(None)

    def on_mount(self) -> None:
        self.border_title = "Current step"

    def render(self) -> Text:
        v = self.view
        if v is None:
            return Text("waiting for the first step…", style=DIM)
        r = v.record
        width = max(self.content_size.width, 20)
        height = max(self.content_size.height, 4)
        lines: list[Text] = []

        head = Text()
        head.append(f"step {_n(r.step)}", style="bold")
        head.append(f"   {fmt_seconds(r.duration_s)}   policy ", style=DIM)
        head.append(r.policy)
        head.append(f"   {len({it.request_id for it in r.items})} requests", style=DIM)  # static: prefill + padding items
        if r.predicted_s is not None:  # the step-cost model's forecast, made before the step ran
            head.append(f"   forward {fmt_seconds(r.forward_s)} (predicted {fmt_seconds(r.predicted_s)})", style=DIM)
        lines.append(head)

        total = r.num_prefill_tokens + r.num_decode_tokens + r.num_padding_tokens
        parts = [(getattr(r, f"num_{k}_tokens"), KIND_COLOURS[k]) for k in STACK_ORDER]
        if r.token_budget > 0:
            label = f" {_n(total)}/{_n(r.token_budget)} ({total / r.token_budget:.0%})"
            budget_line = Text("budget ", style=DIM)
            budget_line.append_text(bar(width - len(label) - 7, parts, r.token_budget))
        else:
            label = f" {_n(total)} tokens (no step budget)"
            budget_line = Text("tokens ", style=DIM)
            budget_line.append_text(bar(width - len(label) - 7, parts, total))
        budget_line.append(label)
        lines.append(budget_line)

        counts = Text()
        for k in ("prefill", "decode", "padding"):
            counts.append("■ ", style=KIND_COLOURS[k])
            counts.append(f"{k} {_n(getattr(r, f'num_{k}_tokens'))}   ")
        if r.num_cached_tokens:
            counts.append(f"cached {_n(r.num_cached_tokens)}", style=DIM)
        lines.append(counts)
        if r.error:
            lines.append(Text(f"✖ step failed: {r.error}", style="bold red"))

        item_lines = self._item_lines(r.items, v.prompt_lengths, width)
        room = height - len(lines)
        if len(item_lines) > room:
            hidden = len(item_lines) - room + 1
            item_lines = item_lines[: room - 1] + [Text(f"… {hidden} more lines", style=DIM)]
        lines.extend(item_lines)
        return Text("\n").join(lines)

    @staticmethod
    def _item_lines(items: list[StepItem], prompt_lengths: dict[str, int], width: int) -> list[Text]:
        lines = []
        # ids up to 24 characters, fewer in a narrow panel: a decode chip (after the 13-column
        # "decode ×N" indent) and a prefill line's token count must fit the width
        id_width = min(max((len(i.request_id) for i in items), default=8), 24, max(8, width - 22))
        for it in items:
            if it.kind == "decode":
                continue
            line = Text()
            line.append("▌", style=KIND_COLOURS[it.kind])
            line.append(f"{it.kind:<8}", style=KIND_COLOURS[it.kind])
            line.append(f"{shorten(it.request_id, id_width):<{id_width}}  ")
            line.append(f"{_n(it.num_tokens):>5} tok", style="bold")
            if it.kind == "prefill":
                end = it.position + it.num_tokens
                line.append(f"  pos {_n(it.position)}–{_n(end - 1)}")
                prompt = prompt_lengths.get(it.request_id)
                if prompt:
                    line.append(f" of {_n(prompt)}", style=DIM)
                    if end >= prompt:
                        line.append("  last chunk → first token", style=DIM)
            lines.append(line)
        decodes = [it for it in items if it.kind == "decode"]
        if decodes:
            line = Text()
            line.append("▌", style=KIND_COLOURS["decode"])
            line.append(f"decode ×{len(decodes)}  ", style=KIND_COLOURS["decode"])
            indent = len(line.plain)
            for it in decodes:
                chip = f"{shorten(it.request_id, id_width)}@{it.position}"
                if len(line.plain) + len(chip) + 1 > width and len(line.plain) > indent:
                    lines.append(line)
                    line = Text(" " * indent)
                line.append(chip)
                line.append(" ")
            lines.append(line)
        return lines


def shorten(request_id: str, width: int) -> str:
    """`request_id` in at most `width` characters, cut in the middle: the ids of a prompt
    list's requests (`ID-0`, `ID-1`) and of n > 1 choices (`ID#1`) differ only at the end."""
    if len(request_id) <= width:
        return request_id
    tail = (width - 1) // 2
    return f"{request_id[:width - 1 - tail]}…{request_id[-tail:]}"


# --- the strip of recent steps ----------------------------------------------------------


class StepStrip(Widget):
    """One column per step, newest on the right: decode, prefill and padding tokens stacked
    against the token budget (the ─ line); under them, each step's duration."""

    records: reactive[tuple[StepRecord, ...]] = reactive(tuple, always_update=True)
    zoom: reactive[int] = reactive(DEFAULT_ZOOM)
    GUTTER = 7

    def on_mount(self) -> None:
        self._update_title()

    def watch_zoom(self) -> None:
        self._update_title()

    def _update_title(self) -> None:
        self.border_title = f"Recent steps  ·  {ZOOM_WIDTHS[self.zoom]} cell(s) per step (+/-)"
        legend = " ".join(f"[{KIND_COLOURS[k]}]■[/] {k}" for k in ("prefill", "decode", "padding"))
        self.border_subtitle = f"{legend}  [{DIM}]─[/] budget  [{DURATION}]▆[/] step time"

    def visible(self) -> tuple[StepRecord, ...]:
        cols = max(self.content_size.width - self.GUTTER, 1) // ZOOM_WIDTHS[self.zoom]
        return self.records[-cols:] if cols else ()

    def render(self) -> Text:
        width, height = self.content_size.width, self.content_size.height
        rows = height - 2  # then a row of step durations and the step axis
        shown = self.visible()
        if not shown or rows < 2:
            return Text("waiting for steps…", style=DIM)
        w = ZOOM_WIDTHS[self.zoom]
        gap = 1 if w >= 3 else 0
        budget = next((r.token_budget for r in reversed(shown) if r.token_budget), 0)
        peak = max(r.num_prefill_tokens + r.num_decode_tokens + r.num_padding_tokens for r in shown)
        top = max(peak, budget * 1.12, 1)
        budget_row = round(budget / top * rows) if budget else None  # rows counted from the bottom, 1-based

        columns = [self._column(r, rows, top) for r in shown]
        lines = []
        for y in range(rows, 0, -1):  # top row first
            line = Text()
            if y == rows:
                line.append(f"{_n(round(top)):>5} ┤", style=DIM)
            elif y == budget_row:
                line.append(f"{_n(budget):>5} ┤", style=DIM)
            elif y == 1:
                line.append(f"{0:>5} ┤", style=DIM)
            else:
                line.append(f"{'':>5} │", style=DIM)
            for col in columns:
                kind = col[y - 1]
                if kind is not None:
                    line.append("█" * (w - gap), style=KIND_COLOURS[kind])
                    line.append(" " * gap)
                elif y == budget_row:
                    line.append("─" * w, style=DIM)
                else:
                    line.append(" " * w)
            lines.append(line)
        lines.append(self._duration_row(shown, w, gap))
        axis = Text(" " * self.GUTTER)
        first, last = f"#{_n(shown[0].step)}", f"#{_n(shown[-1].step)}"
        span = len(shown) * w
        if span >= len(first) + len(last) + 1:
            axis.append(first + " " * (span - len(first) - len(last)) + last, style=DIM)
        else:
            axis.append(last.rjust(max(span, len(last))), style=DIM)
        lines.append(axis)
        return Text("\n").join(line[:width] if len(line) > width else line for line in lines)

    def _duration_row(self, shown: tuple[StepRecord, ...], w: int, gap: int) -> Text:
        """Each step's duration as a bar height ▁…█ (a long prefill under `continuous` stalls
        everything: it shows here as a spike); the gutter gives the longest one shown."""
        longest = max(r.duration_s for r in shown)
        label = fmt_seconds(longest).replace(" ", "")
        row = Text(f"{label:>5} ", style=DIM)
        row.append("t", style=f"bold {DIM}")
        for r in shown:
            level = round(r.duration_s / longest * (len(BARS) - 1)) if longest > 0 else 0
            row.append(BARS[level] * (w - gap) + " " * gap, style=DURATION)
        return row

    @staticmethod
    def _column(r: StepRecord, rows: int, top: float) -> list[str | None]:
        """Kind per row, bottom first; every non-zero kind gets at least one cell."""
        cells: list[str | None] = []
        acc = 0
        for kind in STACK_ORDER:
            n = getattr(r, f"num_{kind}_tokens")
            if n <= 0:
                continue
            acc += n
            end = min(rows, round(acc / top * rows))
            end = max(end, min(rows, len(cells) + 1))
            cells.extend([kind] * (end - len(cells)))
        return cells + [None] * (rows - len(cells))


# --- queues and KV ----------------------------------------------------------------------


class QueuePanel(Widget):
    view: reactive[QueueView | None] = reactive(None)

    def on_mount(self) -> None:
        self.border_title = "Queues · KV cache"

    def render(self) -> Text:
        v = self.view
        if v is None:
            return Text("no data yet", style=DIM)
        width = max(self.content_size.width, 20)
        lines = []
        q = Text()
        q.append("waiting ", style=DIM)
        q.append(f"{_n(v.num_waiting):<6}", style="bold")
        q.append("running ", style=DIM)
        q.append(_n(v.num_running), style="bold")
        lines.append(q)
        if v.num_waiting_for_grammar:
            lines.append(Text(f"   {_n(v.num_waiting_for_grammar)} of them compiling a grammar", style=DIM))
        colour = "#4fd18b" if v.kv_usage < 0.7 else "#e5c84f" if v.kv_usage < 0.9 else "#e55f4f"
        kv = Text("KV ", style=DIM)
        kv.append_text(bar(width - 9, [(v.kv_usage, colour)], 1.0))
        kv.append(f" {v.kv_usage:>4.0%}", style="bold")
        lines.append(kv)
        if v.num_blocks is not None and v.num_free_blocks is not None:
            lines.append(Text(f"   {_n(v.num_blocks - v.num_free_blocks)}/{_n(v.num_blocks)} blocks in use", style=DIM))
        p = Text("preemptions ", style=DIM)
        p.append(_n(v.num_preemptions), style="bold red" if v.num_preemptions else "bold")
        lines.append(p)
        if v.prefix_cache_hit_rate is not None:
            h = Text("prefix-cache hits ", style=DIM)
            h.append(f"{v.prefix_cache_hit_rate:.0%}", style="bold")
            lines.append(h)
        f = Text("finished ", style=DIM)
        f.append(_n(v.num_finished), style="bold")
        if v.finish_reasons:
            f.append("  " + " · ".join(f"{k} {_n(n)}" for k, n in v.finish_reasons), style=DIM)
        lines.append(f)
        return Text("\n").join(lines)


# --- latency ----------------------------------------------------------------------------


class LatencyPanel(Widget):
    """TTFT and ITL recent P50/P99 and output tokens/s, each with a sparkline."""

    view: reactive[LatencyView | None] = reactive(None)

    def compose(self) -> ComposeResult:
        for name in ("ttft", "itl", "rate"):
            with Horizontal(classes="latency-row"):
                yield Label("", id=f"{name}-label", classes="latency-label")
                yield Sparkline([], id=f"{name}-spark")

    def on_mount(self) -> None:
        self.border_title = "Latency · throughput"
        self.watch_view(self.view)

    def watch_view(self, v: LatencyView | None) -> None:
        if not self.is_mounted:
            return
        v = v or LatencyView(None, None, None, None, None, (), (), ())

        def label(name: str, p50: float | None, p99: float | None) -> Text:
            t = Text(f"{name:<5}", style="bold")
            t.append(" p50 ", style=DIM)
            t.append(f"{fmt_seconds(p50):>8}")
            t.append("  p99 ", style=DIM)
            t.append(f"{fmt_seconds(p99):>8}")
            return t

        self.query_one("#ttft-label", Label).update(label("TTFT", v.ttft_p50, v.ttft_p99))
        self.query_one("#itl-label", Label).update(label("ITL", v.itl_p50, v.itl_p99))
        rate = Text("out  ", style="bold")
        rate.append(" now ", style=DIM)
        rate.append(f"{v.tokens_per_s:>8.1f}" if v.tokens_per_s is not None else f"{'–':>8}")
        rate.append(" tokens/s", style=DIM)
        self.query_one("#rate-label", Label).update(rate)
        self.query_one("#ttft-spark", Sparkline).data = list(v.ttft_series)
        self.query_one("#itl-spark", Sparkline).data = list(v.itl_series)
        self.query_one("#rate-spark", Sparkline).data = list(v.rate_series)


# --- requests ---------------------------------------------------------------------------


class RequestTable(DataTable):
    """Running requests (then waiting ones) from the latest snapshot, with progress."""

    snapshot: reactive[EngineSnapshot | None] = reactive(None)
    MAX_ROWS = 200
    MORE = "…"  # the key (and id cell) of the "N more" row
    COLUMNS = ("request", "state", "prio", "prompt", "output")

    def on_mount(self) -> None:
        self.border_title = "Requests"
        self.cursor_type = "none"
        self.zebra_stripes = True
        labels = ("request", "state", "prio", "prompt computed/total", "output generated/max")
        for key, label in zip(self.COLUMNS, labels):
            self.add_column(label, key=key)

    def watch_snapshot(self, snap: EngineSnapshot | None) -> None:
        """Update rows in place (keyed by request id) so the user's scroll position stays."""
        if snap is None:
            self.clear()
            self.border_title = "Requests"
            return
        self.border_title = f"Requests · {len(snap.running)} running · {len(snap.waiting)} waiting"
        # prompts still being prefilled first (the interesting ones), then decodes, then waiting
        running = sorted(snap.running, key=lambda r: r.num_computed_tokens >= r.num_prompt_tokens)
        reqs = [*running, *snap.waiting]
        rows = {r.request_id: self._row(r) for r in reqs[: self.MAX_ROWS]}
        if len(reqs) > self.MAX_ROWS:
            rows[self.MORE] = (self.MORE, Text(f"{len(reqs) - self.MAX_ROWS} more", style=DIM), "", "", "")
        for key in [k for k in self.rows if k.value not in rows]:
            self.remove_row(key)
        for rid, cells in rows.items():
            if rid in self.rows:
                for column, value in zip(self.COLUMNS, cells):
                    self.update_cell(rid, column, value)
            else:
                self.add_row(*cells, key=rid)
        rank = {rid: i for i, rid in enumerate(rows)}
        self.sort("request", key=lambda cell: rank.get(str(cell), len(rank)))  # the id cell: a Text

    @staticmethod
    def _row(r: RequestSnapshot) -> tuple:
        computed = min(r.num_computed_tokens, r.num_prompt_tokens)
        state_style = "bold" if r.status == "running" else DIM
        return (
            Text(r.request_id),  # the server's string, not markup: "[/]" in an id raised MarkupError
            Text(r.status, style=state_style),
            str(r.priority),
            progress_cell(computed, r.num_prompt_tokens, KIND_COLOURS["prefill"]),
            progress_cell(r.num_generated_tokens, r.max_tokens, KIND_COLOURS["decode"]),
        )
