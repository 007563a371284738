"""Rotary position embedding: tables from the model's own rotary module, applied per token.

Taking cos/sin from transformers' rotary module makes every static RoPE variant (default,
`linear`, `llama3`, `yarn` with its attention factor) match exactly; engine/model/spec.py
refuses the variants whose tables depend on the sequence's length. Gemma 3's module takes a
layer type (local and global layers have different bases): one table per type.
"""

from __future__ import annotations

import inspect

import torch


def rope_tables(rotary, keys: set[str], max_position: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """key -> (cos, sin), each [P, R] in `dtype` on `device` (R = rotary dims <= head_dim)."""
    positions = torch.arange(max_position)[None]
    x = torch.zeros(1, 1, 1, dtype=dtype, device=device)  # the rotary module reads only its dtype and device
    by_type = "layer_type" in inspect.signature(rotary.forward).parameters
    tables = {}
    for key in keys:
        cos, sin = rotary(x, positions, key) if by_type else rotary(x, positions)
        tables[key] = (cos[0].to(device, dtype), sin[0].to(device, dtype))
    return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, R]. Rotate-half on the first R dims (R < D: partial
    rotary, Phi-3 style), the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
