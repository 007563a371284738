"""The in-process runner on the tiny model: the spike's long prompts land mid-stream (gated
on tokens received, not on a clock), every step is recorded, failures are reported."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.bench import workload
from engine.bench.runner import run_in_process
from tests.engine.util import tiny_config

VOCAB = range(100, 259)


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
async def test_spike_lands_mid_stream(tiny_model, policy):
    reqs = workload.spike(num_streams=4, num_long=1, long_len=300, stream_tokens=48, spike_after=0.25, vocab=VOCAB)
    async with Engine(tiny_config(policy=policy, max_num_batched_tokens=64, chunk_size=32), loaded=tiny_model) as engine:
        timings, duration, steps = await run_in_process(engine, reqs)
    steady, [long] = timings[:4], timings[4:]
    assert all(t.ok for t in timings) and long.tag == "long"
    assert [t.num_output_tokens for t in timings] == [48] * 4 + [16]
    # sent once the streams had received a quarter of their tokens, while they still decode
    received = sum(sum(1 for x in t.token_times if x < long.arrival) for t in steady)
    assert 4 * 48 // 4 <= received < 4 * 48
    assert all(t.first_token < long.arrival < t.end for t in steady)
    # every step recorded, the last one included; prefill of the long prompt shows up in them
    assert [s.step for s in steps] == list(range(1, len(steps) + 1)) and steps[-1].step == engine.scheduler.step
    assert sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps) == sum(
        len(r.prompt_token_ids) + r.max_tokens - 1 for r in reqs)
    assert 0 < duration and max(t.end for t in timings) - min(t.arrival for t in timings) <= duration


async def test_gate_opens_when_it_never_can_be_reached(tiny_model):
    reqs = [workload.BenchRequest([120, 121], 4, 0.0, "steady"), workload.BenchRequest([122], 2, 0.0, "long", 10_000)]
    async with Engine(tiny_config(policy="continuous"), loaded=tiny_model) as engine:
        timings, _, _ = await run_in_process(engine, reqs)
    assert all(t.ok for t in timings) and timings[1].arrival >= timings[0].end


async def test_failed_requests_are_reported(tiny_model):
    reqs = [workload.BenchRequest([9999], 4, 0.0), workload.BenchRequest([120], 3, 0.0)]  # id outside the vocab
    async with Engine(tiny_config(policy="continuous"), loaded=tiny_model) as engine:
        timings, _, _ = await run_in_process(engine, reqs)
    assert not timings[0].ok and "RequestError" in timings[0].error
    assert timings[1].ok and timings[1].num_output_tokens == 3
