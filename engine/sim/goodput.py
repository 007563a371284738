"""Goodput: the highest arrival rate at which at least `target` of the requests meet both a
TTFT and an ITL SLO, found by bisection over the rate (each probe is one simulation).

A request meets the SLOs as engine-bench's goodput counts it (`engine.bench.stats.goodput`):
it completed, its TTFT <= slo_ttft_s and every inter-token gap <= slo_itl_s. The fraction
meeting them is taken to fall as the rate rises; the search brackets the first rate that
fails (doubling or halving from `start`), then halves the bracket until it is within
`rel_tol` of its upper end.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.bench.stats import RequestTiming, goodput

TARGET = 0.9


def fraction_meeting(timings: list[RequestTiming], slo_ttft_s: float | None, slo_itl_s: float | None) -> float:
    if not timings:
        return 0.0
    return goodput(timings, 1.0, slo_ttft_s, slo_itl_s) / len(timings)  # over 1 s: the count that met them


def find(probe: Callable[[float], float], start: float = 1.0, rel_tol: float = 0.03, max_probes: int = 24,
         target: float = TARGET) -> tuple[float, list[tuple[float, float]]]:
    """`probe(rate)` -> fraction of requests meeting the SLOs at that rate. Returns the highest
    rate found to meet `target` (0.0 if even start / 2**12 does not; only a lower bound when no
    probe failed) and every probe made."""
    if start <= 0:
        raise ValueError(f"start rate must be > 0, got {start}")
    probes: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        frac = probe(rate)
        probes.append((rate, frac))
        return frac >= target

    lo, hi = 0.0, None
    rate = start
    if ok(rate):
        lo = rate
        while len(probes) < max_probes:
            rate *= 2
            if not ok(rate):
                hi = rate
                break
            lo = rate
        else:
            return lo, probes  # still meeting at the last doubling: report what was shown
    else:
        hi = rate
        for _ in range(12):
            rate /= 2
            if ok(rate):
                lo = rate
                break
            hi = rate
        else:
            return 0.0, probes
    while hi - lo > rel_tol * hi and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes
