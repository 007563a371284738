"""Logits processing before sampling: logit bias (and min_tokens' masks), penalties, min_p.

Pure functions over the whole batch: per-row parameters become tensors, and each function
touches only the rows that use it (gathered, processed together, scattered back). A batch in
which no row asks for any of this skips the module entirely (`needs_processing`), so plain
requests pay nothing. vLLM's order: bias and min_tokens masks, then penalties (repetition,
then frequency and presence), then — in the sampler — temperature, min_p, top-k, top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.messages import Penalties
from engine.sampler import SAMPLING_EPS


class RowSampling(Protocol):
    """What processing needs of a row (PlanItem has these fields)."""

    temperature: float
    min_p: float
    penalties: Penalties | None
    logit_bias: list[tuple[int, float]]


def needs_processing(rows: Sequence[RowSampling]) -> bool:
    return any(r.penalties is not None or r.logit_bias or r.min_p > 0.0 for r in rows)


def process_logits(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """logits: [B, V] float32, modified in place and returned; rows[i] describes logits[i]."""
    apply_logit_bias(logits, [(i, t, b) for i, r in enumerate(rows) for t, b in r.logit_bias])
    penalised = [i for i, r in enumerate(rows) if r.penalties is not None]
    if penalised:
        apply_penalties(logits, penalised, [rows[i].penalties for i in penalised])
    with_min_p = [i for i, r in enumerate(rows) if r.min_p > 0.0 and r.temperature >= SAMPLING_EPS]
    if with_min_p:
        apply_min_p(logits, with_min_p, [rows[i].min_p for i in with_min_p], [rows[i].temperature for i in with_min_p])
    return logits


def apply_logit_bias(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """logits: [B, V]; entries: (row, token id, bias). One scatter-add for the whole batch."""
    if not entries:
        return
    rows, tokens, biases = zip(*entries)
    logits.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(biases, dtype=logits.dtype),
                      accumulate=True)


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """[P, V] float32: how often each token occurs in each list (one scatter-add for all)."""
    counts = torch.zeros(len(token_lists), vocab_size)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    counts.index_put_((rows, ids), torch.ones(len(ids)), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, rows: list[int], penalties: Sequence[Penalties]) -> None:
    """logits: [B, V]; rows: the P rows with penalties. Repetition (HF/vLLM: a logit of a token
    seen in the prompt or the output is divided by r when positive, multiplied when negative),
    then frequency and presence (OpenAI: minus f x count - p x [count > 0], output tokens only)."""
    vocab = logits.shape[1]
    idx = torch.tensor(rows)
    x = logits[idx]  # [P, V]
    out_counts = token_counts([p.output_token_ids for p in penalties], vocab)  # [P, V]
    rep = torch.tensor([p.repetition for p in penalties])[:, None]  # [P, 1]
    if bool((rep != 1.0).any()):
        prompt_seen = token_counts([p.prompt_token_ids for p in penalties], vocab) > 0  # [P, V]
        seen = prompt_seen | (out_counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency for p in penalties])[:, None]  # [P, 1]
    pres = torch.tensor([p.presence for p in penalties])[:, None]  # [P, 1]
    x = x - freq * out_counts - pres * (out_counts > 0).float()
    logits[idx] = x


def apply_min_p(logits: torch.Tensor, rows: list[int], min_ps: list[float], temperatures: list[float]) -> None:
    """Keep, per row, the tokens whose probability after temperature T is at least min_p times
    the most likely one's: p_i / p_max = exp((l_i - l_max) / T) >= min_p, i.e.
    l_i >= l_max + T log(min_p) — no softmax needed. Greedy rows are not passed (argmax stays)."""
    idx = torch.tensor(rows)
    x = logits[idx]  # [P, V]
    t = torch.tensor(temperatures)[:, None]  # [P, 1]
    floor = x.max(dim=-1, keepdim=True).values + t * torch.tensor([math.log(p) for p in min_ps])[:, None]  # [P, 1]
    logits[idx] = x.masked_fill(x < floor, float("-inf"))
