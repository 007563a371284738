"""Sampling: greedy is argmax, top-k / top-p limits, seeded reproducibility, batch independence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import apply_top_k, apply_top_p, sample, sample_one

V = 50


def random_logits(seed: int, rows: int = 1, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = random_logits(0, rows=8)
    out = sample(logits, [0.0] * 8, [0] * 8, [1.0] * 8, [None] * 8)
    assert out == logits.argmax(dim=-1).tolist()
    for row in logits:
        assert sample_one(row, 0.0, 0, 1.0, None) == int(row.argmax())


def test_greedy_ignores_top_k_top_p_and_generator():
    logits = random_logits(1, rows=4)
    g = gen(0)
    state = g.get_state()
    out = sample(logits, [0.0] * 4, [3, 0, 1, 7], [0.5, 1.0, 0.1, 0.9], [g] * 4)
    assert out == logits.argmax(dim=-1).tolist()
    assert torch.equal(g.get_state(), state), "a greedy row must not draw from its generator"


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.floats(0.05, 20.0), top_p=st.floats(0.05, 1.0))
def test_top_k_1_is_greedy_at_any_temperature(seed, temperature, top_p):
    row = random_logits(seed)[0]
    assert sample_one(row, temperature, 1, top_p, gen(seed)) == int(row.argmax())


@pytest.mark.parametrize("top_p", [1e-6, 1e-3, 0.0])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_tiny_top_p_is_greedy(top_p, temperature):
    logits = random_logits(2, rows=20)
    for i, row in enumerate(logits):
        assert sample_one(row, temperature, 0, top_p, gen(i)) == int(row.argmax())


def test_same_seed_same_samples():
    logits = random_logits(3, rows=1)[0]

    def draw(seed: int) -> list[int]:
        g = gen(seed)
        return [sample_one(logits, 1.5, 0, 1.0, g) for _ in range(64)]

    a, b = draw(42), draw(42)
    assert a == b
    assert len(set(a)) > 5, "temperature 1.5 over 50 tokens should not be (near) deterministic"
    assert draw(43) != a


def test_sample_of_a_request_is_independent_of_other_rows():
    """Request 0 (seed 7) yields the same tokens whatever shares its batch: other sampled
    rows with their own generators, greedy rows, different sizes and positions."""
    target = random_logits(4, rows=1)[0]
    steps = 30

    def run(batch_of) -> list[int]:
        g = gen(7)
        others = gen(999)
        out = []
        for step in range(steps):
            rows, temps, ks, ps, gens, pos = batch_of(step, target, others)
            logits = torch.stack(rows)
            tokens = sample(logits, temps, ks, ps, [g if i == pos else x for i, x in enumerate(gens)])
            out.append(tokens[pos])
        return out

    def alone(step, t, others):
        return [t], [0.8], [20], [0.9], [None], 0

    def crowded(step, t, others):
        n = 1 + step % 5
        noise = [torch.randn(V, generator=others) for _ in range(n)]
        rows = noise[: step % n] + [t] + noise[step % n :]
        pos = step % n
        temps = [0.0 if i % 2 else 1.3 for i in range(n + 1)]
        temps[pos] = 0.8
        ks = [5] * (n + 1)
        ks[pos] = 20
        ps = [0.7] * (n + 1)
        ps[pos] = 0.9
        gens = [gen(1000 + step * 10 + i) for i in range(n + 1)]
        return rows, temps, ks, ps, gens, pos

    assert run(alone) == run(crowded)


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, -2.0, 4.0])
    kept = apply_top_k(logits, 2)
    assert torch.isfinite(kept).tolist() == [False, True, False, False, True]
    assert torch.equal(kept[torch.isfinite(kept)], torch.tensor([5.0, 4.0]))
    assert torch.equal(apply_top_k(logits, 0), logits)
    assert torch.equal(apply_top_k(logits, 5), logits)
    assert torch.equal(apply_top_k(logits, 99), logits)


# Probabilities 0.5, 0.25, 0.15, 0.1 on tokens 3, 0, 2, 1 (deliberately not sorted).
NUCLEUS_PROBS = torch.tensor([0.25, 0.1, 0.15, 0.5])
ORDER = [3, 0, 2, 1]


@pytest.mark.parametrize(
    "p,size",
    [(0.01, 1), (0.49, 1), (0.51, 2), (0.74, 2), (0.76, 3), (0.89, 3), (0.91, 4), (0.999, 4)],
)
def test_top_p_keeps_the_minimal_nucleus(p, size):
    logits = NUCLEUS_PROBS.log() + 2.0  # a shift must not matter
    kept = apply_top_p(logits, p)
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == set(ORDER[:size])
    # kept logits are untouched
    finite = torch.isfinite(kept)
    assert torch.equal(kept[finite], logits[finite])
    # the kept mass reaches p, and dropping the smallest kept token would not
    mass = NUCLEUS_PROBS[ORDER[:size]].sum().item()
    assert mass >= p and mass - NUCLEUS_PROBS[ORDER[size - 1]].item() < p


def test_top_p_samples_only_from_the_nucleus():
    logits = NUCLEUS_PROBS.log()
    g = gen(5)
    seen = {sample_one(logits, 1.0, 0, 0.7, g) for _ in range(300)}
    assert seen == {3, 0}


def test_top_k_then_top_p():
    # top_k=3 renormalises to 0.5/0.9, 0.25/0.9, 0.15/0.9 = .556, .278, .167; p=0.8 keeps two.
    logits = NUCLEUS_PROBS.log()
    g = gen(6)
    seen = {sample_one(logits, 1.0, 3, 0.8, g) for _ in range(300)}
    assert seen == {3, 0}


def test_temperature_sharpens_and_flattens():
    logits = NUCLEUS_PROBS.log()
    n = 2000

    def freq_top(temperature: float) -> float:
        g = gen(11)
        return sum(sample_one(logits, temperature, 0, 1.0, g) == 3 for _ in range(n)) / n

    cold, warm, hot = freq_top(0.25), freq_top(1.0), freq_top(10.0)
    assert cold > 0.9
    assert math.isclose(warm, 0.5, abs_tol=0.05)
    assert hot < 0.35
