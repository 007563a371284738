"""Statistics over per-request timings: percentiles, throughput, goodput.

Latency and throughput figures cover the requests that completed (`ok`); failed requests
are only counted, in `num_failed`. See docs/bench.md for every definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    tag: str
    arrival: float  # absolute times (time.perf_counter) of send, first token, each token
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per delivery of tokens (remote: content chunk)
    end: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ok: bool = True
    error: str | None = None  # why the request failed, when it did

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (last token - first token) / (n - 1).
        Unlike ITL it stays per token when a server streams several tokens in one chunk."""
        if self.first_token is None or not self.token_times or self.num_output_tokens < 2:
            return None
        return (self.token_times[-1] - self.first_token) / (self.num_output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    return percentile_of_sorted(sorted(values), p)


def percentile_of_sorted(xs: list[float], p: float) -> float:
    """percentile() of values already in ascending order (a summary sorts each list once)."""
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def goodput(timings: list[RequestTiming], duration_s: float, slo_ttft_s: float | None, slo_itl_s: float | None) -> float:
    """Completed requests per second that met every given SLO: TTFT <= slo_ttft_s, and every
    inter-token gap <= slo_itl_s. With no SLO given, the completed requests per second."""
    if duration_s <= 0:
        return 0.0
    good = 0
    for t in timings:
        if not t.ok or t.ttft is None:
            continue
        if slo_ttft_s is not None and t.ttft > slo_ttft_s:
            continue
        if slo_itl_s is not None and t.itls and max(t.itls) > slo_itl_s:
            continue
        good += 1
    return good / duration_s


def summarize(timings: list[RequestTiming], duration_s: float, slo_ttft_s=None, slo_itl_s=None) -> dict:
    done = [t for t in timings if t.ok]
    ttfts = sorted(t.ttft for t in done if t.ttft is not None)
    itls = sorted(x for t in done for x in t.itls)  # millions in a simulated hour: sorted once
    tpots = sorted(t.tpot for t in done if t.tpot is not None)
    e2es = sorted(t.e2e for t in done if t.e2e is not None)
    at = percentile_of_sorted
    out_tokens = sum(t.num_output_tokens for t in done)
    ms = 1000.0
    return {
        "num_requests": len(timings),
        "num_failed": len(timings) - len(done),
        "duration_s": duration_s,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms_p50": at(ttfts, 50) * ms,
        "ttft_ms_p90": at(ttfts, 90) * ms,
        "ttft_ms_p99": at(ttfts, 99) * ms,
        "itl_ms_p50": at(itls, 50) * ms,
        "itl_ms_p99": at(itls, 99) * ms,
        "itl_ms_max": (itls[-1] if itls else float("nan")) * ms,
        "tpot_ms_p50": at(tpots, 50) * ms,
        "tpot_ms_p99": at(tpots, 99) * ms,
        "e2e_ms_p50": at(e2es, 50) * ms,
        "e2e_ms_p99": at(e2es, 99) * ms,
        "goodput_rps": goodput(timings, duration_s, slo_ttft_s, slo_itl_s),
    }
