"""engine.bench.workload: every named workload is reproducible by seed, keeps to its
documented lengths and to the vocabulary, and spaces arrivals as documented."""

from __future__ import annotations

import random
import statistics

import pytest

from engine.bench import workload
from engine.bench.limit import output_limit
from engine.bench.workload import WORKLOADS, make

NAMES = sorted(WORKLOADS)


@pytest.mark.parametrize("name", NAMES)
def test_reproducible_by_seed(name):
    a = make(name, seed=1, num_requests=16, rate=4.0)
    assert a == make(name, seed=1, num_requests=16, rate=4.0)
    assert a != make(name, seed=2, num_requests=16, rate=4.0)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in make(name, seed=2, num_requests=16, rate=4.0)]


def test_mixed_lengths():
    reqs = make("mixed", seed=0, num_requests=64)
    assert len(reqs) == 64
    long = [r for i, r in enumerate(reqs) if i % 4 == 3]
    short = [r for i, r in enumerate(reqs) if i % 4 != 3]
    assert len(long) == 16 and all(r.tag == "long" for r in long) and all(r.tag == "short" for r in short)
    assert all(400 <= len(r.prompt_token_ids) <= 900 for r in long)
    assert all(16 <= len(r.prompt_token_ids) <= 160 for r in short)
    assert all(16 <= r.max_tokens <= 160 for r in reqs)
    assert all(r.arrival_s == 0.0 and r.after_tokens == 0 for r in reqs)
    assert len({r.max_tokens for r in reqs}) > 10  # varied, not constant


def test_single_is_one_user():
    (r,) = make("single", seed=0)
    assert (len(r.prompt_token_ids), r.max_tokens, r.arrival_s, r.after_tokens) == (128, 256, 0.0, 0)
    reqs = make("single", seed=0, num_requests=3, rate=2.0)
    assert len(reqs) == 3 and reqs[0].arrival_s == 0.0 and reqs[1].arrival_s < reqs[2].arrival_s


def test_spike_shape():
    reqs = make("spike", seed=0)
    steady = [r for r in reqs if r.tag == "steady"]
    long = [r for r in reqs if r.tag == "long"]
    assert len(steady) == 12 and len(long) == 2 and reqs[:12] == steady  # streams first, then the spikes
    assert all(16 <= len(r.prompt_token_ids) <= 48 and r.max_tokens == 128 for r in steady)
    assert all(r.arrival_s == 0.0 and r.after_tokens == 0 for r in steady)
    assert all(len(r.prompt_token_ids) == 2000 and r.max_tokens == 16 for r in long)
    # one at a time: each waits until the streams have received 25 and 60 % of their tokens
    assert [r.after_tokens for r in long] == [int(12 * 128 * f) for f in (0.25, 0.60)]


def test_spike_options():
    assert len(make("spike", num_requests=6)) == 6  # 4 streams + 2 long prompts
    reqs = workload.spike(num_streams=3, num_long=1, long_len=50, stream_tokens=40, spike_after=0.5, spike_at_s=1.5)
    assert [r.tag for r in reqs] == ["steady"] * 3 + ["long"]
    assert reqs[-1].after_tokens == 60 and reqs[-1].arrival_s == 1.5 and len(reqs[-1].prompt_token_ids) == 50
    assert workload.spike(num_long=1, spike_after=0.0)[-1].after_tokens == 0
    assert workload.spike(num_long=3, spike_after=0.5, spike_every=0.4)[-1].after_tokens == 12 * 128  # capped at 100 %


def test_sharegpt_like_bounds():
    reqs = make("sharegpt-like", seed=0, num_requests=400)
    prompts = [len(r.prompt_token_ids) for r in reqs]
    outputs = [r.max_tokens for r in reqs]
    assert all(4 <= n <= 1500 for n in prompts) and all(4 <= m <= 400 for m in outputs)
    assert 150 <= statistics.median(prompts) <= 260  # log-normal, median e^5.3 ~ 200
    assert 110 <= statistics.median(outputs) <= 190  # median e^5.0 ~ 148
    assert max(prompts) > 600 and min(prompts) < 60  # heavy-tailed both ways


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("vocab_size, lo, hi", [(259, 100, 259), (20, 10, 20), (50_000, 100, 20_000)])
def test_token_ids_in_vocab(name, vocab_size, lo, hi):
    reqs = make(name, seed=3, num_requests=12, vocab_size=vocab_size)
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert ids and lo <= min(ids) and max(ids) < hi
    assert len(ids) > min(hi - lo, 100) // 2  # spread over the range


@pytest.mark.parametrize("name", ["mixed", "sharegpt-like"])
def test_poisson_arrivals(name):
    reqs = make(name, seed=5, num_requests=300, rate=10.0)
    arrivals = [r.arrival_s for r in reqs]
    assert all(0 < a < b for a, b in zip(arrivals, arrivals[1:]))
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.2)  # exponential gaps, mean 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.25)  # exponential: stdev = mean
    assert all(r.arrival_s == 0.0 for r in make(name, seed=5, num_requests=20, rate=0.0))


def test_spike_ignores_rate():
    assert make("spike", seed=0, rate=5.0) == make("spike", seed=0)


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        make("nope")


def test_output_limit_is_the_prefill_rate_times_the_output_share():
    reqs = [workload.BenchRequest([1] * 300, 100, 0.0), workload.BenchRequest([1] * 500, 100, 0.0)]
    assert output_limit(500.0, reqs) == pytest.approx(500.0 * 200 / 1000)


def test_spike_overlap_shape():
    reqs = workload.make("spike-overlap")
    steady = [r for r in reqs if r.tag == "steady"]
    long = [r for r in reqs if r.tag.startswith("long")]
    assert len(steady) == 12 and [r.tag for r in long] == ["long-1", "long-2"]
    assert all(len(r.prompt_token_ids) == 2000 for r in long)
    assert long[0].after_tokens == long[1].after_tokens == 12 * 128 // 4  # both gated mid-stream
    assert (long[0].after_gate_s, long[1].after_gate_s) == (0.0, 0.5)  # the second 0.5 s later


def test_shared_prefix_shape():
    reqs = make("shared-prefix", seed=1, num_requests=200, rate=4.0)
    groups: dict[str, list] = {}
    for r in reqs:
        groups.setdefault(r.tag, []).append(r.prompt_token_ids)
    assert len(groups) == 8 and all(len(g) >= 10 for g in groups.values())  # 8 prefixes, all used
    for prompts in groups.values():
        assert all(p[:1000] == prompts[0][:1000] for p in prompts)  # one 1,000-token prefix per group
        assert all(1016 <= len(p) <= 1064 for p in prompts)  # plus a 16-64 token user turn
    heads = {tuple(g[0][:1000]) for g in groups.values()}
    assert len(heads) == 8 and {r.max_tokens for r in reqs} == {32}
    arrivals = [r.arrival_s for r in reqs]
    assert all(0 < a < b for a, b in zip(arrivals, arrivals[1:]))


@pytest.mark.parametrize("vocab", [range(100, 20000), range(0, 16384), range(5, 6), range(0, 49152, 3)])
def test_prompt_draws_what_choice_draws_and_leaves_the_generator_where_it_would(vocab):
    """_prompt batches the Mersenne Twister's words; the tokens and the generator's state after
    are those of one rng.choice per token (so every workload is what it always was)."""
    for seed in range(10):
        fast, slow = random.Random(seed), random.Random(seed)
        for n in (0, 1, 7, 200, 3000):
            assert workload._prompt(fast, n, vocab) == [slow.choice(vocab) for _ in range(n)]
            assert fast.getstate() == slow.getstate()
