"""Logits processing before sampling: logit bias (and min_tokens' masks), penalties, min_p.

Pure functions over the whole batch: per-row parameters become tensors, and each function
touches only what it changes: bias and penalties the (row, token) pairs concerned (one
scatter each), min_p the rows that use it (gathered, processed together, scattered back). A batch in
which no row asks for any of this skips the module entirely (`needs_processing`), so plain
requests pay nothing. vLLM's order: bias and min_tokens masks, then penalties (repetition,
then frequency and presence), then — in the sampler — temperature, min_p, top-k, top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.messages import Penalties, TokenBias
from engine.sampler import SAMPLING_EPS


class RowSampling(Protocol):
    """What processing needs of a row (PlanItem has these fields)."""

    temperature: float
    min_p: float
    penalties: Penalties | None
    logit_bias: TokenBias | None


def needs_processing(rows: Sequence[RowSampling]) -> bool:
    return any(r.penalties is not None or r.logit_bias or r.min_p > 0.0 for r in rows)


def process_logits(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """logits: [B, V] float32, modified in place (if contiguous) and returned; rows[i] describes logits[i]."""
    logits = logits.contiguous()
    apply_logit_bias(logits, [(i, r.logit_bias) for i, r in enumerate(rows) if r.logit_bias])
    penalised = [i for i, r in enumerate(rows) if r.penalties is not None]
    if penalised:
        apply_penalties(logits, penalised, [rows[i].penalties for i in penalised])
    with_min_p = [i for i, r in enumerate(rows) if r.min_p > 0.0 and r.temperature >= SAMPLING_EPS]
    if with_min_p:
        apply_min_p(logits, with_min_p, [rows[i].min_p for i in with_min_p], [rows[i].temperature for i in with_min_p])
    return logits


def apply_logit_bias(logits: torch.Tensor, biased: list[tuple[int, TokenBias]]) -> None:
    """logits: [B, V]; biased: (row, its bias). One scatter-add for the whole batch."""
    if not biased:
        return
    rows = torch.cat([torch.full((len(bias),), i, dtype=torch.int64) for i, bias in biased])  # [K]
    tokens = torch.cat([bias.token_ids for _, bias in biased])  # [K]
    values = torch.cat([bias.biases for _, bias in biased]).to(logits.dtype)  # [K]
    logits.index_put_((rows, tokens), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[int], penalties: Sequence[Penalties]) -> None:
    """logits: [B, V]; rows: the rows with penalties. Repetition (HF/vLLM: a logit of a token
    seen in the prompt or the output is divided by r when positive, multiplied when negative),
    then frequency and presence (OpenAI: minus f x count - p x [count > 0], output tokens only).

    Sparse: only the (row, token) pairs that occur are touched — keys row * V + token, made
    unique with their counts by `torch.unique` — so the cost grows with the tokens the rows
    hold, not with the vocabulary."""
    vocab = logits.shape[1]
    out_keys = _keys(rows, [p.output_token_ids for p in penalties], vocab)  # [N_out]
    prompt_keys = _keys(rows, [p.prompt_token_ids for p in penalties], vocab)  # [N_prompt]
    keys = torch.unique(torch.cat([out_keys, prompt_keys]))  # [K] sorted: every (row, token) seen
    if not len(keys):
        return
    out_unique, out_counts = torch.unique(out_keys, return_counts=True)
    counts = torch.zeros(len(keys))  # [K]: occurrences in the output
    counts[torch.searchsorted(keys, out_unique)] = out_counts.float()
    per_row = torch.zeros(logits.shape[0], 3)  # [B, 3]: repetition, frequency, presence
    per_row[torch.tensor(rows)] = torch.tensor([[p.repetition, p.frequency, p.presence] for p in penalties])
    rep, freq, pres = per_row[torch.div(keys, vocab, rounding_mode="floor")].unbind(-1)  # [K] each
    flat = logits.view(-1)  # [B * V]
    x = flat[keys]  # [K]
    x = torch.where(x > 0, x / rep, x * rep)  # r = 1 leaves x exactly as it is
    x = x - freq * counts - pres * (counts > 0).float()
    flat[keys] = x


def _keys(rows: list[int], token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[N] int64: row * vocab + token for every token of every list (repeats kept)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    return row_ids * vocab + ids


def apply_min_p(logits: torch.Tensor, rows: list[int], min_ps: list[float], temperatures: list[float]) -> None:
    """Keep, per row, the tokens whose probability after temperature T is at least min_p times
    the most likely one's: p_i / p_max = exp((l_i - l_max) / T) >= min_p, i.e.
    l_i >= l_max + T log(min_p) — no softmax needed. Greedy rows are not passed (argmax stays)."""
    idx = torch.tensor(rows)
    x = logits[idx]  # [P, V]
    t = torch.tensor(temperatures)[:, None]  # [P, 1]
    floor = x.max(dim=-1, keepdim=True).values + t * torch.tensor([math.log(p) for p in min_ps])[:, None]  # [P, 1]
    logits[idx] = x.masked_fill(x < floor, float("-inf"))
