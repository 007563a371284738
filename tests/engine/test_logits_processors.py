"""Logits processing (penalties, min_p, logit bias, min_tokens masks) against a straightforward
per-row reference over the same logits; neutral parameters leave sampling unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.logits_processors import needs_processing, process_logits
from engine.logprobs import token_logprobs
from engine.messages import Penalties, TokenBias
from engine.sampler import sample

V = 40


@dataclass
class Row:
    temperature: float = 1.0
    min_p: float = 0.0
    penalties: Penalties | None = None
    bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias)

    @property
    def logit_bias(self) -> TokenBias | None:  # as the plan carries it
        return TokenBias.of(self.bias) if self.bias else None


def reference(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """One row, one token at a time, as the APIs define it."""
    x = [float(v) for v in logits]
    for t, b in row.bias:
        x[t] += b
    p = row.penalties
    if p is not None:
        seen = set(p.prompt_token_ids) | set(p.output_token_ids)
        for t in range(len(x)):
            if t in seen:
                x[t] = x[t] / p.repetition if x[t] > 0 else x[t] * p.repetition
            count = p.output_token_ids.count(t)
            x[t] -= p.frequency * count + (p.presence if count else 0.0)
    if row.min_p > 0 and row.temperature > 0:
        probs = torch.softmax(torch.tensor(x) / row.temperature, dim=-1)
        x = [v if probs[t] >= row.min_p * probs.max() else -math.inf for t, v in enumerate(x)]
    return torch.tensor(x)


token_lists = st.lists(st.integers(0, V - 1), max_size=30)
rows_strategy = st.builds(
    Row,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    penalties=st.none() | st.builds(
        Penalties, presence=st.floats(-2, 2), frequency=st.floats(-2, 2),
        repetition=st.sampled_from([1.0, 0.7, 1.3, 2.0]), output_token_ids=token_lists, prompt_token_ids=token_lists),
    bias=st.lists(st.tuples(st.integers(0, V - 1), st.floats(-100, 100)), max_size=4, unique_by=lambda e: e[0])
    | st.lists(st.tuples(st.integers(0, V - 1), st.just(-math.inf)), max_size=3, unique_by=lambda e: e[0]),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(rows_strategy, min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_batch_equals_per_row_reference(rows, seed):
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
    expected = torch.stack([reference(logits[i], r) for i, r in enumerate(rows)])
    got = process_logits(logits.clone(), rows)
    finite = expected.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert torch.allclose(got[finite], expected[finite], atol=1e-4)


def test_penalties_known_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = Row(penalties=Penalties(presence=0.5, frequency=0.25, repetition=2.0, output_token_ids=[0, 0, 1],
                                  prompt_token_ids=[2]))
    got = process_logits(logits.clone(), [row])[0].tolist()
    # token 0: 2/2 - 0.25*2 - 0.5; token 1: -2*2 - 0.25 - 0.5; token 2 (prompt only): 1/2; token 3 untouched
    assert got == pytest.approx([1.0 - 0.5 - 0.5, -4.0 - 0.25 - 0.5, 0.5, 0.5])


def test_neutral_rows_skip_processing_and_greedy_is_unchanged():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1)) * 3
    rows = [Row(temperature=0.0) for _ in range(8)]
    assert not needs_processing(rows)
    neutral = [Row(temperature=0.0, penalties=Penalties(presence=0.0, frequency=0.0, repetition=1.0,
                                                        output_token_ids=[1, 2, 3], prompt_token_ids=[]),
                   bias=[(5, 0.0)])] * 8
    processed = process_logits(logits.clone(), neutral)
    assert sample(processed, [0.0] * 8, [0] * 8, [1.0] * 8, [None] * 8) == logits.argmax(-1).tolist()


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    got = process_logits(logits.clone(), [Row(temperature=1.0, min_p=0.3)])[0]
    assert got.isfinite().tolist() == [True, True, True, False]  # 0.05 < 0.3 * 0.5 <= 0.15


def test_bias_minus_inf_bans_and_plus_100_forces():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    top = int(logits[0].argmax())
    out = process_logits(logits.clone(), [Row(bias=[(top, -math.inf)]), Row(bias=[(7, 100.0)])])
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    for _ in range(20):
        a, b = sample(out, [1.0, 1.0], [0, 0], [1.0, 1.0], gens)
        assert a != top and b == 7


def test_token_logprobs_sorted_and_consistent():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) * 2
    chosen = [int(logits[0].argmax()), 4, 9]
    out = token_logprobs(logits, chosen, [5, 0, 3])
    ref = torch.log_softmax(logits, -1)
    for i, e in enumerate(out):
        assert e.token_id == chosen[i] and e.logprob == pytest.approx(float(ref[i, chosen[i]]), abs=1e-6)
        values = [lp for _, lp in e.top]
        assert values == sorted(values, reverse=True) and len(e.top) == [5, 0, 3][i]
        for t, lp in e.top:
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-6)
    assert out[0].top[0] == (chosen[0], pytest.approx(out[0].logprob))


async def test_a_requests_bias_is_made_once_not_per_step(tiny_model):
    """A bias on the whole vocabulary used to become Python tuples at every step (~2 s a step
    for the whole batch with n=16); every step's item now carries the one TokenBias made for it."""
    from engine import Engine, SamplingParams
    from tests.engine.util import run_request, tiny_config

    seen = []

    def record(plan):
        seen.extend(item.logit_bias for item in plan.items if item.sample)

    vocab = len(tiny_model.tokenizer)
    bias = {t: -1.0 for t in range(vocab)}
    async with Engine(tiny_config(policy="continuous"), loaded=tiny_model, fault_hook=record) as engine:
        result = await run_request(engine, [3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                        logit_bias=bias))
        assert len(result.token_ids) == 6 and len(seen) == 6
        assert all(b is seen[0] for b in seen) and len(seen[0]) == vocab
        seen.clear()
        eos = tiny_model.tokenizer.eos_token_id
        await run_request(engine, [3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, logit_bias={7: 2.0},
                                                            min_tokens=2))
        masked, plain = seen[:2], seen[2:]  # under min_tokens EOS is banned as well
        assert all(b.token_ids.tolist() == [7, eos] and b.biases.tolist() == [2.0, -math.inf] for b in masked)
        assert all(b is plain[0] and b.token_ids.tolist() == [7] for b in plain)
