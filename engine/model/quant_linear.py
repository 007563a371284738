"""A projection on GGUF blocks: the block kernel for few rows, a dense fp32 GEMM for many.

A decode-heavy step reads each weight once and does little arithmetic per byte, so the
~0.6-1.1 byte/weight blocks (engine/model/quant_kernel.py) beat 4-byte fp32 weights. A step
with many rows is compute-bound, where oneDNN's prepacked fp32 GEMM is faster than our kernel;
above `max_rows` rows the dense copy runs. Both give the same products (dequantization is
exact), so the choice changes only the order of fp32 additions, never greedy text.

With `int8_activations` (weight_format "gguf-q8") the kernel steps quantize x to int8 per
32-block and take integer block products (quant_kernel.matmul_q8), as llama.cpp does: faster
at few rows, and the logits move by the activations' rounding, so greedy text may differ from
transformers'. Steps above `max_rows` still run the dense fp32 copy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine.config import WEIGHT_FORMATS
from engine.cpu import kernel_max_rows  # steps of up to this many rows use the block kernel, by its path
from engine.model import quant_kernel
from engine.model.gguf_weights import QuantWeight, UnsupportedArchitecture, read_gguf_weights
from engine.model.linear import Linear



class QuantLinear:
    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, dense: Linear | None,
                 max_rows: int | None = None, isa: str | None = None, int8_activations: bool = False):
        # parts: row blocks of one type, stacked in order (fused q/k/v, gate/up); bias: [N] or None
        if len({p.qtype for p in parts}) != 1:
            raise ValueError(f"cannot fuse GGUF weights of different types: {[(p.gguf_name, p.qtype) for p in parts]}")
        self.qtype = parts[0].qtype
        self.blocks = torch.cat([p.blocks for p in parts]) if len(parts) > 1 else parts[0].blocks  # [N, bytes]
        # [N, K/32, 2] fp32 (all but Q8_0) or None; the int8 kernel reads the blocks' own fp16 scales
        if int8_activations:
            self.scales = None
        elif parts[0].scales is not None:  # repacked k-quants: their blocks hold no scales
            self.scales = torch.cat([p.scales for p in parts]) if len(parts) > 1 else parts[0].scales
        else:
            self.scales = quant_kernel.block_scales(self.blocks, self.qtype)
        self.bias = bias
        self.dense = dense  # None: every step runs the kernel
        self.isa = isa or quant_kernel.best_isa()
        self.max_rows = kernel_max_rows(self.isa, int8_activations) if max_rows is None else max_rows
        self.int8_activations = int8_activations  # kernel steps: quant_kernel.matmul_q8, else matmul

    @property
    def kind(self) -> str:
        return "gguf-q8" if self.int8_activations else "gguf"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if self.dense is not None and x.shape[0] > self.max_rows:
            return self.dense(x)
        if self.int8_activations:
            y = quant_kernel.matmul_q8(x, self.blocks, self.qtype, self.isa)
        else:
            y = quant_kernel.matmul(x, self.blocks, self.qtype, self.isa, self.scales)
        return y if self.bias is None else y.add_(self.bias)


class QuantLinearStack:
    """One projection whose output rows come from GGUF weights of different block types (a
    Q4_K_M file's fused q/k/v: q and k Q4_K or Q5_0, v Q6_K or Q8_0): each part runs the block
    kernel on its own rows and the outputs are stacked, for steps of at most `max_rows` rows;
    larger steps run the dense copy of the whole, as QuantLinear does."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None, dense: Linear):
        self.parts = parts  # each without bias or dense copy
        self.bias = bias
        self.dense = dense
        self.max_rows = min(p.max_rows for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        y = torch.cat([p(x) for p in self.parts], dim=1)
        return y if self.bias is None else y.add_(self.bias)


def native_weights(hf_model, gguf: Path | None, weight_format: str, device: torch.device, dtype: torch.dtype,
                   linear: str) -> dict[int, QuantWeight] | None:
    """The blocks of `hf_model`'s projections to run natively, keyed by id() of the parameter,
    or None where weight_format (config.toml [model]) resolves to dequantized fp32. "gguf-q8"
    takes the same blocks as "gguf" (the caller builds its QuantLinears with int8 activations)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight_format {weight_format!r}; choose from {WEIGHT_FORMATS}")
    if weight_format == "dequantized":
        return None
    usable = gguf is not None and device.type == "cpu" and dtype == torch.float32 and linear != "int8"
    if weight_format == "auto" and not (usable and quant_kernel.quant_kernel_available()):
        return None
    if gguf is None:
        raise ValueError(f"weight_format {weight_format!r} needs a .gguf model (this one has no GGUF blocks); use 'auto' or 'dequantized'")
    if not usable:
        raise ValueError(f"weight_format {weight_format!r} runs on CPU with float32 activations and a dense linear backend "
                         f"(got {device.type}, {dtype}, linear_backend {linear!r})")
    quant_kernel.require_kernel()
    cfg = hf_model.config
    types = quant_kernel.Q8_TYPES if weight_format == "gguf-q8" else quant_kernel.GGUF_TYPES
    try:
        found = read_gguf_weights(gguf, cfg.num_attention_heads, cfg.num_key_value_heads, types)
    except UnsupportedArchitecture as e:
        if weight_format != "auto":
            raise ValueError(f"weight_format {weight_format!r}: {e}; use 'auto' or 'dequantized'") from None
        print(f"[stepwise] {e}: every weight runs dequantized to fp32", file=sys.stderr)
        return None
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    if weight_format != "auto":
        for name, (gguf_name, qtype) in found.other.items():
            if name in params:
                raise ValueError(f"weight_format {weight_format!r}: tensor {gguf_name} is {qtype}, which the native kernel cannot "
                                 f"run (it runs {', '.join(types)}); use 'auto' to run it dequantized")
    return {id(params[name]): w for name, w in found.runnable.items() if name in params}
