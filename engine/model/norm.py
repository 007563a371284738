"""RMSNorm in the two arithmetics transformers uses, so each family matches bit for bit."""

from __future__ import annotations

import torch


class RMSNorm:
    """Llama: normalise in fp32, cast back, multiply by w. Gemma: normalise and multiply by
    (1 + w) in fp32, then cast back (its weights are stored as offsets from 1)."""

    def __init__(self, weight: torch.Tensor, eps: float, gemma: bool = False):
        self.eps = eps
        self.gemma = gemma
        self.weight = 1.0 + weight.float() if gemma else weight  # [E] (or [D] for q/k norms)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., E]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x * self.weight).to(dtype)
        return self.weight * x.to(dtype)
