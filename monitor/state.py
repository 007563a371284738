"""The dashboard's model: everything derived from the event stream, free of any UI.

The App feeds it events and hands the widgets the small immutable views it computes
(`LatencyView`, `QueueView`, `StatusView`); the widgets only draw.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

from engine.messages import EngineSnapshot, StepRecord
from monitor.source import Connected, Connecting, Disconnected, EngineState, Refused

HISTORY = 2048  # steps kept for the strip
LATENCY_SAMPLES = 512  # "recent" for the P50/P99 figures
SERIES = 240  # points per sparkline
RATE_WINDOW_S = 10.0  # output tokens/s is averaged over this much step time


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, math.ceil(q / 100 * len(data)))
    return data[rank - 1]


def output_tokens(record: StepRecord) -> int:
    """Tokens sampled in a step: one per request that got its first token (ttft_s) or a
    next one (itl_s); decode items as a floor for servers that leave those lists empty."""
    decodes = sum(1 for it in record.items if it.kind == "decode")
    return max(len(record.ttft_s) + len(record.itl_s), decodes)


@dataclass(frozen=True)
class StatusView:
    kind: str  # "connecting" | "connected" | "disconnected" | "refused" (no more retries)
    description: str
    reason: str = ""
    retry_in_s: float = 0.0
    attempt: int = 0
    activity: str = "connecting"


@dataclass(frozen=True)
class LatencyView:
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    tokens_per_s: float | None
    ttft_series: tuple[float, ...]  # recent TTFT samples, oldest first
    itl_series: tuple[float, ...]  # per-step median ITL
    rate_series: tuple[float, ...]  # output tokens/s per second of step time


@dataclass(frozen=True)
class QueueView:
    num_waiting: int  # in the scheduler's queue, plus those still compiling their grammar
    num_waiting_for_grammar: int
    num_running: int
    kv_usage: float
    num_blocks: int | None
    num_free_blocks: int | None
    num_preemptions: int
    prefix_cache_hit_rate: float | None
    num_finished: int
    finish_reasons: tuple[tuple[str, int], ...]


class MonitorState:
    def __init__(self, history: int = HISTORY):
        self.records: deque[StepRecord] = deque(maxlen=history)
        self.snapshot: EngineSnapshot | None = None
        self.config: dict = {}
        self.engine_note = ""  # "engine loading" / "engine dead: …" from the state endpoint
        self.replicas: list[str] = []  # a cluster ingress's replicas (from the state endpoint)
        # KV usage as last received: a record's is as of its step, a snapshot's as of its poll
        # (read after its step), so whichever came last is the newer, across a restart too
        self.kv_usage: float | None = None
        self.status = StatusView("connecting", "")
        self.num_steps_seen = 0
        self._ttft: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self._itl: deque[float] = deque(maxlen=LATENCY_SAMPLES * 4)
        self._ttft_series: deque[float] = deque(maxlen=SERIES)
        self._itl_series: deque[float] = deque(maxlen=SERIES)
        self._rate_series: deque[float] = deque(maxlen=SERIES)
        self._bucket: tuple[int, int] | None = None  # (second, tokens) being filled
        self._window: deque[tuple[float, float, int]] = deque()  # (start, end, tokens) within RATE_WINDOW_S
        self._finish_reasons: Counter[str] = Counter()

    # --- feeding ------------------------------------------------------------------------

    def on_connection(self, event: Connecting | Connected | Disconnected | Refused) -> None:
        match event:
            case Connecting(description, attempt, activity):
                if self.status.kind == "disconnected":  # keep saying why while retrying
                    self.status = StatusView("disconnected", description, self.status.reason, 0.0, attempt, activity)
                else:
                    self.status = StatusView("connecting", description, attempt=attempt, activity=activity)
            case Connected(description):
                # a new connection starts a new history: the server may have restarted (an idle
                # new engine sends no step that would show it), and the steps missed meanwhile
                # would make rates and counts straddle the gap
                self.reset()
                self.status = StatusView("connected", description)
            case Disconnected(description, reason, retry_in_s, attempt):
                self.status = StatusView("disconnected", description, reason, retry_in_s, attempt)
            case Refused(description, reason):
                self.status = StatusView("refused", description, reason)

    def on_state(self, state: EngineState) -> None:
        self.snapshot = state.snapshot  # None while the engine is loading
        if state.snapshot is not None:
            self.kv_usage = state.snapshot.kv_usage
        self.config = state.config
        self.engine_note = "" if state.ready else f"engine dead: {state.dead}" if state.dead else "engine loading"
        self.replicas = [r.name for r in state.replicas]

    def add(self, record: StepRecord) -> None:
        if self.records and (record.step < self.records[-1].step or record.step == self.records[-1].step
                             and not record.is_idle):
            self.reset()  # the engine restarted: its step numbers start over
        for f in record.finished:
            self._finish_reasons[f.finish_reason] += 1
        self.kv_usage = record.kv_usage
        if record.is_idle:
            return  # no step ran: only the finished requests count
        self.records.append(record)
        self.num_steps_seen += 1
        self._ttft.extend(record.ttft_s)
        self._ttft_series.extend(record.ttft_s)
        self._itl.extend(record.itl_s)
        if record.itl_s:
            self._itl_series.append(percentile(record.itl_s, 50))
        self._add_rate(record)

    def reset(self) -> None:
        """Forget the history (keeps the connection status and the count of steps seen)."""
        status, seen = self.status, self.num_steps_seen
        self.__init__(self.records.maxlen)
        self.status, self.num_steps_seen = status, seen

    def _add_rate(self, record: StepRecord) -> None:
        tokens = output_tokens(record)
        end = record.start_time + record.duration_s
        if not math.isfinite(end):  # a server's nonsense (1e308 + 1e308) has no second to count in
            return
        self._window.append((record.start_time, end, tokens))
        while self._window and self._window[0][1] < end - RATE_WINDOW_S:
            self._window.popleft()
        second = int(end)
        if self._bucket is None:
            self._bucket = (second, tokens)
        elif second == self._bucket[0]:
            self._bucket = (second, self._bucket[1] + tokens)
        elif second > self._bucket[0]:
            self._rate_series.append(float(self._bucket[1]))
            for _ in range(min(second - self._bucket[0] - 1, SERIES)):
                self._rate_series.append(0.0)  # idle seconds
            self._bucket = (second, tokens)
        # a record from the past (clock step back): counted in the window only

    # --- views ------------------------------------------------------------------------

    @property
    def last(self) -> StepRecord | None:
        return self.records[-1] if self.records else None

    def tokens_per_s(self) -> float | None:
        """Output tokens/s over the last RATE_WINDOW_S of step time; 0 once the engine is idle
        (its snapshot, as of the last step or later, has nothing running or waiting): no step
        comes to bring the window down then, and "now" would stay at the load's rate."""
        snap, last = self.snapshot, self.last
        if snap is not None and last is not None and snap.step >= last.step and not snap.running and not snap.waiting:
            return 0.0
        if not self._window:
            return None
        start = min(s for s, _, _ in self._window)
        end = self._window[-1][1]
        span = end - start
        if span <= 0:
            return None
        return sum(t for _, _, t in self._window) / span

    def latency(self) -> LatencyView:
        return LatencyView(
            ttft_p50=percentile(self._ttft, 50), ttft_p99=percentile(self._ttft, 99),
            itl_p50=percentile(self._itl, 50), itl_p99=percentile(self._itl, 99),
            tokens_per_s=self.tokens_per_s(), ttft_series=tuple(self._ttft_series),
            itl_series=tuple(self._itl_series), rate_series=tuple(self._rate_series),
        )

    def queues(self) -> QueueView | None:
        rec, snap = self.last, self.snapshot
        if rec is None and snap is None:
            return None
        # the step record is the newer source for counts. KV: as last received, and the block
        # count from that same fraction, so "KV 50%" never sits beside another moment's blocks
        kv_usage = self.kv_usage if self.kv_usage is not None else (rec or snap).kv_usage
        grammar = snap.num_waiting_for_grammar if snap else 0  # intake's: no step record counts them
        # handed to the scheduler during the step the snapshot saw: not in that step's record yet
        arriving = snap.num_arriving if snap and (rec is None or snap.step >= rec.step) else 0
        return QueueView(
            num_waiting=(rec.num_waiting if rec else len(snap.waiting)) + arriving + grammar,
            num_waiting_for_grammar=grammar,
            num_running=rec.num_running if rec else len(snap.running),
            kv_usage=kv_usage,
            num_blocks=snap.num_blocks if snap else None,
            num_free_blocks=snap.num_blocks - round(kv_usage * snap.num_blocks) if snap else None,
            num_preemptions=rec.num_preemptions if rec else snap.num_preemptions,
            prefix_cache_hit_rate=snap.prefix_cache_hit_rate if snap else None,
            num_finished=sum(self._finish_reasons.values()),
            finish_reasons=tuple(sorted(self._finish_reasons.items(), key=lambda kv: -kv[1])),
        )

    def prompt_lengths(self) -> dict[str, int]:
        """request id -> prompt length, from the snapshot (for "chunk … of N")."""
        snap = self.snapshot
        if snap is None:
            return {}
        return {r.request_id: r.num_prompt_tokens for r in (*snap.running, *snap.waiting)}
