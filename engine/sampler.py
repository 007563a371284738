"""Sampling as pure functions of (logits, parameters, per-request generator).

Each request owns a `torch.Generator` seeded from its `seed`, and draws exactly one sample
from it per generated token. What else shares the batch never touches that generator, so
the same seed gives the same text whatever the batch composition.
"""

from __future__ import annotations

import torch

# Temperatures below this are greedy: dividing logits by a (positive) temperature this small
# overflows to inf, and softmax then gives NaN (which used to fail the whole step). vLLM's rule.
SAMPLING_EPS = 1e-5


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [V]. Keep the k largest (k <= 0 = keep all)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits: [V]. Keep the smallest set of tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass before it already reaches p (the top token always stays)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= p
    drop[0] = False  # even for p <= 0, else every logit is -inf and multinomial fails
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def sample_one(
    logits: torch.Tensor,  # [V] float32
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    if temperature < SAMPLING_EPS:
        return int(torch.argmax(logits))
    scaled = apply_top_p(apply_top_k(logits / temperature, top_k), top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor,  # [B, V] float32
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    generators: list[torch.Generator | None],
) -> list[int]:
    greedy = [i for i, t in enumerate(temperatures) if t < SAMPLING_EPS]
    out = [0] * logits.shape[0]
    if greedy:
        # one argmax for every greedy row: the common case stays a single kernel
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, tok in zip(greedy, ids):
            out[i] = tok
    for i, t in enumerate(temperatures):
        if t >= SAMPLING_EPS:
            out[i] = sample_one(logits[i], t, top_ks[i], top_ps[i], generators[i])
    return out
