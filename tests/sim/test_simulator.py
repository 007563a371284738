"""The simulator end to end on a known fake machine: determinism, KV exhaustion and
preemption, refusals as intake refuses, replicas behind each router."""

from __future__ import annotations

import math
import threading

import pytest

from engine.sim import trace as traces
from engine.sim.simulator import BURST_SPAN_S, simulate
from engine.sim.trace import TraceRequest
from tests.sim.util import CAL, config


def summary(res) -> list:
    return [(t.arrival, t.first_token, tuple(t.token_times), t.end, t.ok) for t in res.timings]


def test_same_seed_same_result():
    trace = traces.generate("sharegpt-like", seed=7, num_requests=60, rate=5.0)
    a = simulate(trace, config(), CAL)
    b = simulate(traces.generate("sharegpt-like", seed=7, num_requests=60, rate=5.0), config(), CAL)
    assert summary(a) == summary(b) and a.duration_s == b.duration_s and a.tally.figures() == b.tally.figures()
    c = simulate(traces.generate("sharegpt-like", seed=8, num_requests=60, rate=5.0), config(), CAL)
    assert summary(c) != summary(a)


def test_each_request_gets_its_tokens_one_per_step_and_time_is_the_step_costs():
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=32, output_tokens=5)]
    res = simulate(trace, config(policy="continuous", calibrate_step_cost=False), CAL)
    t = res.timings[0]
    assert t.ok and t.num_output_tokens == 5 and len(t.token_times) == 5
    # first step: a 32-token prefill from position 0; then 4 decodes at context 32..35
    prefill = CAL.forward_s(traces_shape(32, 0, False)) + CAL.overhead["fixed"] + CAL.overhead["sequence"]
    assert t.ttft == pytest.approx(prefill)
    for k, gap in enumerate(t.itls):
        want = CAL.forward_s(traces_shape(1, 32 + k, True)) + CAL.overhead["fixed"] + CAL.overhead["sequence"]
        assert gap == pytest.approx(want)
    assert res.duration_s == pytest.approx(t.end)


def traces_shape(n, ctx, decode):
    from engine.step_cost import shape_of

    return shape_of([(n, ctx, decode)])


def test_kv_exhaustion_preempts_and_every_request_still_finishes():
    trace = [TraceRequest(arrival_s=0.01 * i, prompt_tokens=200, output_tokens=300) for i in range(12)]
    res = simulate(trace, config(policy="continuous", num_blocks=120, max_num_seqs=12), CAL)
    assert all(t.ok and t.num_output_tokens == 300 for t in res.timings)
    assert res.tally.figures()["preemptions"] > 0
    roomy = simulate(trace, config(policy="continuous", num_blocks=2048, max_num_seqs=12), CAL)
    assert roomy.tally.figures()["preemptions"] == 0
    assert roomy.duration_s < res.duration_s  # recomputation costs time


def test_refused_as_intake_refuses():
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=100, output_tokens=2000),  # more than the pool holds
             TraceRequest(arrival_s=0.0, prompt_tokens=10, output_tokens=4)]
    res = simulate(trace, config(num_blocks=64), CAL)
    assert not res.timings[0].ok and "KV cache" in res.timings[0].error
    assert res.timings[1].ok
    full = [TraceRequest(arrival_s=0.0, prompt_tokens=10, output_tokens=4) for _ in range(6)]
    res = simulate(full, config(max_waiting=4), CAL)
    assert [t.ok for t in res.timings] == [True] * 4 + [False] * 2
    assert "queue is full" in res.timings[-1].error


def test_prefix_cache_hits_for_a_shared_group():
    trace = [TraceRequest(arrival_s=1.0 * i, prompt_tokens=300, output_tokens=4, prefix_group="sys", prefix_tokens=256)
             for i in range(4)]
    res = simulate(trace, config(), CAL)
    # the first computes the prefix; the other three find its 16 full blocks
    assert res.tally.cached == 3 * 256


def test_gated_requests_wait_for_tokens():
    trace = traces.generate("spike-overlap", seed=0)
    res = simulate(trace, config(), CAL)
    streams = [t for t in res.timings if t.tag == "steady"]
    long1, long2 = (next(t for t in res.timings if t.tag == f"long-{k}") for k in (1, 2))
    # sent once the streams received a quarter of their tokens; the second 0.5 s later
    quarter = sorted(x for t in streams for x in t.token_times)[len(streams) * 128 // 4 - 1]
    assert long1.arrival == pytest.approx(quarter)
    assert long2.arrival == pytest.approx(long1.arrival + 0.5)


def test_round_robin_takes_turns():
    trace = [TraceRequest(arrival_s=0.001 * i, prompt_tokens=16, output_tokens=8) for i in range(12)]
    res = simulate(trace, config(), CAL, replicas=3, router="round-robin")
    assert res.routed == [4, 4, 4]


def test_least_loaded_avoids_the_busy_replica():
    # one very long request first, then short ones one at a time: they never join it
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=16, output_tokens=2000)]
    trace += [TraceRequest(arrival_s=1.0 + i, prompt_tokens=16, output_tokens=4) for i in range(6)]
    rr = simulate(trace, config(), CAL, replicas=2, router="round-robin")
    ll = simulate(trace, config(), CAL, replicas=2, router="least-loaded")
    assert rr.routed == [4, 3]
    assert ll.routed == [1, 6]


def test_prefix_affinity_keeps_a_group_together_until_the_load_gap_is_too_large():
    groups = [TraceRequest(arrival_s=0.5 * i, prompt_tokens=600, output_tokens=8, prefix_group=i % 2,
                           prefix_tokens=512) for i in range(16)]
    aff = simulate(groups, config(), CAL, replicas=4, router="prefix-affinity")
    rr = simulate(groups, config(), CAL, replicas=4, router="round-robin")
    assert sum(1 for n in aff.routed if n) == 2  # one replica per group
    assert aff.tally.cached == 14 * 512  # everyone after each group's first hits the prefix
    assert rr.tally.cached < aff.tally.cached
    # all at once, one group: past the thresholds (abs 64, rel 1.5 by default) it spills over
    burst = [TraceRequest(arrival_s=0.0, prompt_tokens=600, output_tokens=8, prefix_group="g", prefix_tokens=512)
             for _ in range(200)]
    res = simulate(burst, config(replicas=4, balance_abs_threshold=8), CAL, replicas=4, router="prefix-affinity")
    assert all(n > 0 for n in res.routed) and res.routed[0] == max(res.routed)
    assert all(t.ok for t in res.timings)


def test_a_prefix_under_prefix_min_share_of_the_prompt_is_not_followed():
    """As the ingress routes: a chat template's opening block alone must not pin every
    conversation to one replica (engine-sim's router ignored prefix_min_share)."""
    chats = [TraceRequest(arrival_s=0.2 * i, prompt_tokens=200, output_tokens=8, prefix_group="template",
                          prefix_tokens=32) for i in range(12)]
    follow = simulate(chats, config(replicas=4, prefix_min_share=0.0), CAL, replicas=4, router="prefix-affinity")
    share = simulate(chats, config(replicas=4, prefix_min_share=0.5), CAL, replicas=4, router="prefix-affinity")
    assert sum(1 for n in follow.routed if n) == 1  # any known prefix followed: one replica
    assert all(n > 0 for n in share.routed)  # 32 of 200 tokens is under half: least-loaded


def test_replicas_are_independent_engines():
    # the same trace twice over, two replicas round-robin = each replica sees one copy
    one = [TraceRequest(arrival_s=0.1 * i, prompt_tokens=50 + i, output_tokens=20) for i in range(10)]
    doubled = [r for r in one for _ in range(2)]
    single = simulate(one, config(), CAL)
    pair = simulate(doubled, config(), CAL, replicas=2, router="round-robin")
    assert [t.ttft for t in pair.timings[::2]] == pytest.approx([t.ttft for t in single.timings])
    assert [t.ttft for t in pair.timings[1::2]] == pytest.approx([t.ttft for t in single.timings])
    assert pair.tally.num_steps == 2 * single.tally.num_steps
    assert math.isclose(pair.duration_s, single.duration_s)


@pytest.mark.parametrize("arrival", [5.0, 0.136, 1.0])
def test_static_batch_timeout_ends_on_the_virtual_clock(arrival):
    """(5.0 + 0.05) - 5.0 is 0.04999999999999982: the static policy waited for ever on an Idle
    of 2e-16 s, which moves no clock (engine-sim hung at 100 % CPU)."""
    trace = [TraceRequest(arrival_s=arrival, prompt_tokens=10, output_tokens=5)]
    res = simulate(trace, config(policy="static", batch_timeout_ms=50, max_num_seqs=8), CAL)
    t = res.timings[0]
    assert t.ok and t.num_output_tokens == 5 and t.first_token >= arrival + 0.05


def test_a_run_past_2e7_simulated_seconds_ends():
    """At 2e7 s asyncio's timer test `when < now + 1e-9` fails for a timer due now: the run spun
    at 100 % CPU for ever (a long trace, or one of Unix-epoch arrivals)."""
    trace = [TraceRequest(arrival_s=3e7 + 1.5 * i, prompt_tokens=100, output_tokens=10) for i in range(3)]
    out = []
    t = threading.Thread(target=lambda: out.append(simulate(trace, config(), CAL)), daemon=True)
    t.start()
    t.join(30)  # on a thread: a run that spins fails the test instead of hanging it
    assert out, "the simulation did not end"
    assert all(t.ok and t.num_output_tokens == 10 and 0 < t.ttft < 1 for t in out[0].timings)


def test_first_come_first_served_by_arrival_not_by_trace_line():
    """Request.arrival was the trace's line number: of two requests waiting behind a long one,
    the later arrival on the earlier line ran first (intake stamps arrivals as it accepts them)."""
    trace = [TraceRequest(arrival_s=1.0, prompt_tokens=50, output_tokens=5, tag="late"),
             TraceRequest(arrival_s=0.5, prompt_tokens=50, output_tokens=5, tag="early"),
             TraceRequest(arrival_s=0.0, prompt_tokens=100, output_tokens=400, tag="blocker")]
    res = simulate(trace, config(policy="continuous", max_num_seqs=1), CAL)
    late, early, blocker = res.timings
    assert blocker.end < early.first_token < early.end < late.first_token


def test_a_bench_burst_is_sent_whole():
    """engine-bench stamps the 64 requests of one event-loop turn 30-300 µs apart (2-3 ms in all):
    the engine's scheduler sees them together, so the simulated one must too."""
    gaps = [300e-6 if i % 16 == 0 else 30e-6 for i in range(63)]
    trace = [TraceRequest(arrival_s=sum(gaps[:i]), prompt_tokens=16, output_tokens=4) for i in range(64)]
    assert 0.002 < trace[-1].arrival_s < 0.003
    res = simulate(trace, config(policy="continuous", max_num_seqs=64), CAL, keep_steps=True)
    assert {t.arrival for t in res.timings} == {0.0}
    assert len(res.steps[0].items) == 64  # one step prefills them all


def test_a_train_of_close_requests_is_not_one_burst():
    """Requests 0.9 ms apart chained into one burst: 1,000 of them over 0.9 s were all sent at 0,
    the last one's TTFT counted from 0.9 s before it arrived."""
    trace = [TraceRequest(arrival_s=0.0009 * i, prompt_tokens=20, output_tokens=2) for i in range(1000)]
    res = simulate(trace, config(max_num_seqs=64), CAL, replicas=4)
    for r, t in zip(trace, res.timings):
        assert r.arrival_s - BURST_SPAN_S < t.arrival <= r.arrival_s
