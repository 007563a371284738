"""Paged attention in a C++ kernel for CPUs: attends straight from the paged KV cache.

`TorchAttention` copies every cached K/V row into a workspace (padded to the longest context)
before SDPA; on a CPU, where long-context decodes are memory-bound, that copy costs about as
much as the attention itself. `CpuAttention` reads the cache in place through the block table
(csrc/paged_attention.cpp): one work item per (tile of query tokens, kv head), online softmax
in fp32, cached context then the step's fresh keys. Same semantics as backend.py.

The kernel is compiled at first use (engine/cpp_build.py: -O3 -march=native, or the flags of
STEPWISE_CPU_FEATURES where that restricts the CPU (engine/cpu.py), falling back to
-O3; at::parallel_for follows torch.get_num_threads()). A failed build raises RuntimeError;
`cpu_kernel_available()` lets the engine ask first. float32 and bfloat16 activations (fp32
accumulation) over a cache of their dtype, or a narrower one (kv_cache_dtype: float16, or bfloat16
under float32), stored rounded to nearest even and widened on load (F16C where the CPU has it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.backend import LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.cpp_build import KernelLoader, build_extension, cpu_tag
from engine.cpu import cpu_info

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
_TOKENS_PER_TILE = 8  # query tokens of one sequence per work item (x G heads = its rows)


def _build() -> None:
    """Compile and load the kernel (registers torch.ops.stepwise_cpu.paged_attention)."""
    variants = [(f"native_{cpu_tag()}", ["-O3", *cpu_info().compiler_flags()]), ("generic", ["-O3"])]
    build_extension("stepwise_paged_attention", [_SOURCE], variants, "CPU attention kernel")


_KERNEL = KernelLoader(_build, lambda: torch.ops.stepwise_cpu.paged_attention, "CPU attention kernel")


# activation dtype -> the KV cache dtypes the kernel reads with it
_CACHE_DTYPES = {
    torch.float32: (torch.float32, torch.float16, torch.bfloat16),
    torch.bfloat16: (torch.bfloat16, torch.float16),
}


def cpu_kernel_dtypes(dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """None if the kernel runs `dtype` activations over a `kv_dtype` cache, else why not."""
    if dtype not in _CACHE_DTYPES:
        return f"the CPU kernel runs float32 or bfloat16 models, not dtype {_name(dtype)}"
    if kv_dtype not in _CACHE_DTYPES[dtype]:
        return (f"the CPU kernel cannot read a {_name(kv_dtype)} KV cache (kv_cache_dtype) under a "
                f"{_name(dtype)} model; it takes {', '.join(_name(d) for d in _CACHE_DTYPES[dtype])}")
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_kernel_available() -> bool:
    """Whether the C++ kernel builds and loads here (builds it on the first call)."""
    return _KERNEL.available()


@dataclass
class CpuPlan:
    slot_mapping: torch.Tensor  # [T] int64, -1 = not stored
    tiles: torch.Tensor  # [num_tiles, 5] int32: seq, first token, num tokens, context, first position
    block_tables: torch.Tensor  # [B, W] int32


class CpuAttention:
    name = "cpu"

    def __init__(self, tokens_per_tile: int = _TOKENS_PER_TILE) -> None:
        self._op = _KERNEL.get()  # fail at construction, not in the middle of a step
        self.tokens_per_tile = tokens_per_tile

    def prepare(self, meta: AttentionMetadata) -> CpuPlan:
        # A tile's tokens share every K/V row load (prefill); a decode is a one-token tile.
        tokens_per_tile, tiles, start = self.tokens_per_tile, [], 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            for j in range(0, q_len, tokens_per_tile):
                n = min(tokens_per_tile, q_len - j)
                tiles.append((i, start + j, n, ctx, ctx + j))
            start += q_len
        tiles.sort(key=lambda t: -t[2] * (t[4] + t[2]))  # most keys x rows first: threads balance
        return CpuPlan(
            slot_mapping=meta.slot_mapping.to(torch.int64).contiguous(),
            tiles=torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
        )

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: CpuPlan, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        layer = layer or LayerAttention.plain(q.shape[2])
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, H, D]
        # the kernel stores k/v at their slots (-1: not stored), then attends
        self._op(q, k, v, k_cache, v_cache, plan.slot_mapping, plan.tiles, plan.block_tables, out,
                 layer.scale, layer.window or 0, layer.softcap or 0.0)
        return out
