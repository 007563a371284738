"""engine.bench.stats and report.result on hand-made timings: percentiles against numpy,
TTFT/ITL/E2E/TPOT derivation, goodput under each SLO combination, summarize's fields."""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest

from engine.bench import cli, report
from engine.bench.stats import RequestTiming, goodput, percentile, summarize
from engine.messages import StepRecord

rng = random.Random(0)
LISTS = [[5.0], [2.0, 1.0], [3.0, 1.0, 2.0], [1.0, 1.0, 4.0, 4.0], [rng.uniform(0, 100) for _ in range(10)],
         [rng.expovariate(1.0) for _ in range(101)], [rng.gauss(0, 1) for _ in range(37)]]


@pytest.mark.parametrize("values", LISTS, ids=lambda v: f"n{len(v)}")
@pytest.mark.parametrize("p", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p, method="linear")), rel=1e-12, abs=1e-12)
    assert values == LISTS[LISTS.index(values)]  # input left unsorted


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([], 0))


def timing(ttft=None, gaps=(), arrival=10.0, ok=True, tag="", tail=0.01) -> RequestTiming:
    """A request sent at `arrival`, first token after `ttft`, then one token after each gap."""
    t = RequestTiming(tag=tag, arrival=arrival, ok=ok, num_prompt_tokens=7)
    if ttft is not None:
        times = [arrival + ttft]
        for g in gaps:
            times.append(times[-1] + g)
        t.first_token, t.token_times, t.num_output_tokens = times[0], times, len(times)
    t.end = (t.token_times[-1] if t.token_times else arrival) + tail
    return t


def test_timing_derivations():
    t = timing(0.5, [0.2, 0.3], tail=0.2)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.2, 0.3])
    assert t.e2e == pytest.approx(1.2)
    assert t.tpot == pytest.approx(0.25)  # (last - first) / (3 - 1)
    one = timing(0.4)
    assert one.itls == [] and one.tpot is None and one.ttft == pytest.approx(0.4)
    none = RequestTiming(tag="", arrival=1.0)
    assert none.ttft is None and none.e2e is None and none.itls == [] and none.tpot is None


def test_tpot_counts_tokens_not_chunks():
    # remote mode: 2 content chunks, but the usage chunk said 5 tokens
    t = RequestTiming(tag="", arrival=0.0, first_token=1.0, token_times=[1.0, 2.0], num_output_tokens=5, end=2.0)
    assert t.itls == [1.0]
    assert t.tpot == pytest.approx(0.25)


GOOD = timing(0.1, [0.05, 0.05])
SLOW_FIRST = timing(0.5, [0.05])
STALL = timing(0.1, [0.05, 0.3])
BOTH_BAD = timing(0.5, [0.3])
FAILED = timing(0.1, [0.01], ok=False)
NO_TOKEN = timing(None)  # ok, but never produced a token
SINGLE = timing(0.1)  # one token: no gaps to judge
ALL = [GOOD, SLOW_FIRST, STALL, BOTH_BAD, FAILED, NO_TOKEN, SINGLE]


@pytest.mark.parametrize("slo_ttft, slo_itl, good", [
    (None, None, [GOOD, SLOW_FIRST, STALL, BOTH_BAD, SINGLE]),
    (0.2, None, [GOOD, STALL, SINGLE]),
    (None, 0.1, [GOOD, SLOW_FIRST, SINGLE]),
    (0.2, 0.1, [GOOD, SINGLE]),
    (0.01, 0.01, []),
])
def test_goodput(slo_ttft, slo_itl, good):
    assert goodput(ALL, 2.0, slo_ttft, slo_itl) == pytest.approx(len(good) / 2.0)


def test_goodput_boundaries():
    exact = timing(0.125, [0.0625, 0.0625], arrival=0.0)  # binary fractions: no rounding
    assert goodput([exact], 1.0, 0.125, 0.0625) == pytest.approx(1.0)  # meeting an SLO exactly is good
    assert goodput(ALL, 0.0, None, None) == 0.0
    assert goodput([], 1.0, 0.1, 0.1) == 0.0


def test_summarize_fields():
    ok = [GOOD, SLOW_FIRST, STALL, BOTH_BAD, SINGLE]
    s = summarize([*ok, FAILED], 4.0, 0.2, 0.1)
    assert s["num_requests"] == 6 and s["num_failed"] == 1 and s["duration_s"] == 4.0
    assert s["output_tokens"] == 3 + 2 + 3 + 2 + 1  # the failed request's tokens do not count
    assert s["output_tokens_per_s"] == pytest.approx(11 / 4.0)
    assert s["requests_per_s"] == pytest.approx(5 / 4.0)  # completed requests only
    ttfts = [t.ttft for t in ok]
    itls = [g for t in ok for g in t.itls]
    for p in (50, 99):
        assert s[f"ttft_ms_p{p}"] == pytest.approx(1000 * np.percentile(ttfts, p))
        assert s[f"itl_ms_p{p}"] == pytest.approx(1000 * np.percentile(itls, p))
        assert s[f"e2e_ms_p{p}"] == pytest.approx(1000 * np.percentile([t.e2e for t in ok], p))
        assert s[f"tpot_ms_p{p}"] == pytest.approx(1000 * np.percentile([t.tpot for t in ok if t.tpot], p))
    assert s["itl_ms_max"] == pytest.approx(300)
    assert s["goodput_rps"] == pytest.approx(2 / 4.0)


def test_summarize_excludes_failed_latencies():
    slow_failure = timing(100.0, [50.0], ok=False)
    assert summarize([GOOD, slow_failure], 1.0) == summarize([GOOD, timing(ok=False)], 1.0)


def test_summarize_nothing():
    s = summarize([], 0.0)
    assert s["num_requests"] == 0 and s["output_tokens_per_s"] == 0.0 and s["requests_per_s"] == 0.0
    assert math.isnan(s["ttft_ms_p50"]) and math.isnan(s["itl_ms_max"])
    s = summarize([timing(ok=False)], 1.0)
    assert s["num_failed"] == 1 and s["requests_per_s"] == 0.0 and math.isnan(s["e2e_ms_p99"])


def step(n, prefill=0, decode=0, padding=0, cached=0, preemptions=0) -> StepRecord:
    return StepRecord(step=n, start_time=0.0, duration_s=0.01, forward_s=0.01, policy="x", token_budget=64, items=[],
                      num_prefill_tokens=prefill, num_decode_tokens=decode, num_padding_tokens=padding,
                      num_cached_tokens=cached, num_waiting=0, num_running=1, kv_usage=0.1, num_preemptions=preemptions)


def test_result_spike_and_step_figures():
    steady = [timing(0.01, [0.01, 0.02, 0.2], tag="steady"), timing(0.02, [0.01, 0.01], tag="steady")]
    long = [timing(0.3, [0.01], tag="long"), timing(0.5, tag="long"), timing(9.0, tag="long", ok=False)]
    steps = [step(1, prefill=60, cached=20, padding=30), step(2, decode=5, padding=5), step(3, prefill=40, preemptions=1)]
    r = report.result(steady + long, 2.0, steps, None, None)
    gaps = [0.01, 0.02, 0.2, 0.01, 0.01]
    assert r["steady_itl_ms_p50"] == pytest.approx(1000 * np.percentile(gaps, 50))
    assert r["steady_itl_ms_p99"] == pytest.approx(1000 * np.percentile(gaps, 99))
    assert r["steady_itl_ms_max"] == pytest.approx(200)
    assert r["long_ttft_ms_p50"] == pytest.approx(400) and r["long_ttft_ms_max"] == pytest.approx(500)  # failed one out
    assert r["num_steps"] == 3 and r["tokens_processed"] == 140 and r["preemptions"] == 1
    assert r["padding_waste_pct"] == pytest.approx(100 * 35 / 140)
    assert r["prefix_cache_hit_rate"] == pytest.approx(20 / (20 + 100))


def test_step_time_error_p50_is_the_median():
    """It was the upper-middle element: 0.3 here, where the median of an even count is 0.2."""
    steps = [msgspec.structs.replace(step(i), predicted_s=0.01 * (1 + e)) for i, e in enumerate((0.1, 0.3, 0.4, 0.1))]
    assert report.result([GOOD], 1.0, steps, None, None)["step_time_error_p50"] == pytest.approx(0.2)


def test_result_without_steps_or_tags():
    r = report.result([GOOD], 1.0, None, 100, None)
    assert not {"num_steps", "padding_waste_pct", "steady_itl_ms_p99", "long_ttft_ms_max"} & set(r)
    r = report.result([GOOD], 1.0, [], None, None)
    assert r["num_steps"] == 0 and r["padding_waste_pct"] == 0.0 and r["prefix_cache_hit_rate"] == 0.0


def test_table_renders_missing_values():
    text = report.table({"a": summarize([GOOD], 1.0), "b": summarize([], 0.0)})
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| target |") and "–" in lines[3]


def test_ratios_and_json_safety():
    assert cli._ratio(2.0, 4.0) == 0.5
    assert cli._ratio(1.0, 0.0) is None and cli._ratio(float("nan"), 1.0) is None and cli._ratio(None, 1.0) is None
    assert report.strict_json({"a": [float("nan"), 1.5], "b": float("inf"), "c": "x"}) == {"a": [None, 1.5], "b": None, "c": "x"}


@pytest.mark.parametrize("argv, message", [
    (["--set", "num_blocks"], "KEY=VALUE"), (["--set", "num_blocks=many"], "bad value"),
    (["--set", "nope=1"], "unknown config key"), (["--sweep", "max_num_batched_tokens"], "KEY=V1,V2"),
])
def test_cli_rejects_bad_arguments(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main([*argv, "--set", "model=tiny-random", "--out", str(tmp_path), "--config", str(tmp_path / "no.toml")])
