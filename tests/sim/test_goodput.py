from __future__ import annotations

import pytest

from engine.bench.stats import RequestTiming
from engine.sim import goodput


def test_bisection_finds_the_knee():
    knee = 13.7
    rate, probes = goodput.find(lambda r: 1.0 if r <= knee else 0.5, start=1.0)
    assert knee * 0.97 <= rate <= knee
    assert any(f < goodput.TARGET for _, f in probes)
    low, _ = goodput.find(lambda r: 1.0 if r <= 0.2 else 0.0, start=4.0)
    assert 0.2 * 0.97 <= low <= 0.2
    none, _ = goodput.find(lambda r: 0.0, start=1.0)
    assert none == 0.0


def test_fraction_meeting_counts_both_slos():
    def t(ttft, gaps):
        times = [ttft]
        for g in gaps:
            times.append(times[-1] + g)
        return RequestTiming(tag="", arrival=0.0, first_token=ttft, token_times=times, end=times[-1],
                             num_output_tokens=len(times))

    ts = [t(0.1, [0.05, 0.05]), t(0.5, [0.05]), t(0.1, [0.2]), t(0.1, [])]
    assert goodput.fraction_meeting(ts, 0.2, 0.1) == pytest.approx(0.5)
    assert goodput.fraction_meeting(ts, None, 0.1) == pytest.approx(0.75)
    failed = RequestTiming(tag="", arrival=0.0, ok=False)
    assert goodput.fraction_meeting([failed], None, None) == 0.0
