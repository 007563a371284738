"""Dense projections, y = x @ W^T (+ b), with the weight stored for the fastest kernel we have.

On CPU in float32 the weight is reordered once into oneDNN's blocked layout ("prepacked") and
every step runs oneDNN's matmul on it. On this project's AMD Zen 4 machine that is 1.2-2.5x
faster than torch's default path (MKL sgemm on a plain weight) at every batch size from 1 to
512 rows; results agree to ~1e-6 (the order of fp32 accumulation differs), which keeps greedy
parity with transformers. Elsewhere (CUDA, bf16, or a torch without oneDNN) it is F.linear.

"int8" is an opt-in, never chosen by "auto": weights quantized per output channel to int8
(symmetric), activations quantized per step (dynamic quantization, torch's x86 quantized
engine). About 2.5x faster GEMMs than oneDNN fp32 here, ~1 % relative error per projection:
greedy text drifts from transformers' after some tokens (measured in examples/bench_optins.py).
On CPUs without VNNI, torch's x86 int8 GEMM sums pairs of u8*s8 products in saturating int16
(vpmaddubsw); full-range activations overflow it (~25 % error). There activations are quantized
to 7 bits ("reduce_range"), which keeps every pair sum in range at ~1.5 % error.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from engine.config import LINEAR_BACKENDS
from engine.cpu import cpu_info

_PACK_ROWS_HINT = 64  # oneDNN picks its blocking for about this many rows (a decode batch)


def resolve(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'onednn' where it applies (CPU, float32, oneDNN built in), else 'torch'."""
    if kind not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {kind!r}; choose from {LINEAR_BACKENDS}")
    usable = device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if kind == "onednn" and not usable:
        raise ValueError(f"linear backend 'onednn' needs CPU, float32 and a torch built with oneDNN (got {device.type}, {dtype})")
    if kind == "int8" and not (device.type == "cpu" and dtype == torch.float32):
        raise ValueError(f"linear backend 'int8' needs CPU and float32 activations (got {device.type}, {dtype})")
    if kind == "auto":
        return "onednn" if usable else "torch"
    return kind


def int8_reduce_range() -> bool:
    """Whether int8 activations must be 7-bit on this CPU (no VNNI: int16 pair sums saturate)."""
    return not cpu_info().has_vnni


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, reduce_range: bool | None = None):
        # weight: [N, K]; bias: [N] or None
        self.kind = kind
        self.bias = bias
        self.reduce_range = int8_reduce_range() if reduce_range is None else reduce_range
        # Either way a copy: nothing is shared with the caller's (e.g. memory-mapped) weight.
        if kind == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)
        elif kind == "int8":
            self.weight = _quantize_int8(weight.float(), None if bias is None else bias.float())
        else:
            self.weight = weight.clone(memory_format=torch.contiguous_format)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.kind == "int8":  # the bias is packed with the weight
            return torch.ops.quantized.linear_dynamic(x, self.weight, self.reduce_range)
        return F.linear(x, self.weight, self.bias)


def _quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None):
    """Per-output-channel symmetric int8, packed for torch's quantized engine."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # [N]
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao, still supported
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, bias)
