"""The quantized blocks of a GGUF file, by Hugging Face parameter name, for the native path.

transformers dequantizes a GGUF into fp32 (engine/model/loader.py keeps that for everything
else); here the projection weights are read again as they are stored, with gguf's GGUFReader,
and kept as blocks for engine/model/quant_kernel.py. Each weight is [N, K/block weights * block
bytes] uint8: one row of blocks per output row, so rows can be reordered or concatenated freely.

Llama GGUFs store q_proj / k_proj with llama.cpp's RoPE permutation of the rows (within each
head, the two halves interleaved); transformers' loader reverses it, and so do we, row-wise,
so that our rows are transformers' rows (checked bit for bit in tests/model/test_gguf_weights.py).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.model.quant_kernel import GGUF_TYPES, KERNEL_TYPES, repack

# GGUF tensor name (per layer: blk.{i}.<name>) -> transformers parameter name
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
# GGUF archs whose projections map 1:1 onto transformers' (llama: after the q/k unpermute);
# transformers' GGUF loader changes no projection of the others (Gemma: only its norms, by -1)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


class UnsupportedArchitecture(ValueError):
    """The GGUF's architecture has no native path: its projections run dequantized."""


@dataclass(frozen=True)
class QuantWeight:
    blocks: torch.Tensor  # [N, K/block weights * block bytes] uint8
    qtype: str  # a quant_kernel.KERNEL_TYPES name
    gguf_name: str
    scales: torch.Tensor | None = None  # [N, K/32, 2] fp32 (quant_kernel.block_scales): repacked k-quants'

    @property
    def num_rows(self) -> int:
        return self.blocks.shape[0]


@dataclass(frozen=True)
class GgufWeights:
    runnable: dict[str, QuantWeight]  # HF parameter name -> blocks the kernel runs
    other: dict[str, tuple[str, str]]  # HF parameter name -> (GGUF name, type) it does not run


LOSSLESS_TO_Q8_0 = ("Q4_0", "Q5_0", "Q8_0")  # types whose weights are (code) d: Q8_0 holds them exactly


def to_q8_0(w: QuantWeight) -> QuantWeight:
    """The same weights as Q8_0 blocks (the same fp16 d, the codes as int8): exact for
    LOSSLESS_TO_Q8_0, so that a fused projection of Q5_0 q/k and Q8_0 v runs as one Q8_0 weight."""
    if w.qtype == "Q8_0":
        return w
    if w.qtype not in LOSSLESS_TO_Q8_0:
        raise ValueError(f"{w.gguf_name}: {w.qtype} has no exact Q8_0 form")
    n = w.blocks.shape[0]
    b = w.blocks.view(n, -1, KERNEL_TYPES[w.qtype].bytes)  # [N, blocks, block bytes]
    qs = b[..., -16:].to(torch.int16)  # the nibbles: byte j holds weights j (low) and j + 16 (high)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, blocks, 32]
    if w.qtype == "Q5_0":  # the fifth bits, bit j of the 32-bit qh for weight j
        qh = b[..., 2:6].contiguous().view(torch.int32)  # [N, blocks, 1], little-endian as the file
        codes = codes | (((qh >> torch.arange(32, dtype=torch.int32)) & 1) << 4).to(torch.int16)
    codes = codes - (8 if w.qtype == "Q4_0" else 16)
    out = torch.cat([b[..., :2], codes.to(torch.int8).view(torch.uint8)], dim=-1)  # [N, blocks, 34]
    return QuantWeight(out.reshape(n, -1).contiguous(), "Q8_0", w.gguf_name)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def rope_unpermute(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: new row (h, half, i) = old (h, i, half)."""
    dim = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, dim, 2).transpose(1, 2).reshape(-1)


def read_gguf_weights(path: Path, num_heads: int, num_kv_heads: int, types=GGUF_TYPES) -> GgufWeights:
    """`types`: the block types to keep as blocks (the fp32 kernel's by default); others are
    `other`. The k-quants come repacked (quant_kernel.repack), with their scales."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(f"{path.name}: GGUF architecture {arch!r} has no native path (it has: {', '.join(ARCHITECTURES)})")
    runnable, other = {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in types:
            other[name] = (t.name, qtype)
            continue
        blocks = torch.from_numpy(np.array(t.data, copy=True)).reshape(int(t.shape[1]), -1)  # out of the map
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
            blocks = blocks[rope_unpermute(blocks.shape[0], heads)].contiguous()
        blocks, qtype, scales = repack(blocks, qtype)
        runnable[name] = QuantWeight(blocks, qtype, t.name, scales)
    if "lm_head.weight" not in runnable and "lm_head.weight" not in other:  # tied to the embedding
        if "model.embed_tokens.weight" in runnable:
            runnable["lm_head.weight"] = runnable["model.embed_tokens.weight"]
        elif "model.embed_tokens.weight" in other:
            other["lm_head.weight"] = other["model.embed_tokens.weight"]
    del reader  # unmaps the file: every kept block was copied out of it
    if other:
        kinds = Counter(qtype for _, qtype in other.values())
        print(f"[stepwise] {path.name}: {sum(kinds.values())} weight(s) of type(s) "
              f"{', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))} have no native kernel "
              f"(it runs {', '.join(types)}): those run dequantized to fp32", file=sys.stderr)
    return GgufWeights(runnable, other)
