"""The attention backend interface: one object per engine, `prepare` once per step,
`forward` once per layer.

Semantics every backend implements (see metadata.py): query token j of sequence i sits at
position p = context_lens[i] + j and attends to keys 0..p of its own sequence — positions
below context_lens[i] from the paged cache, the rest from this step's fresh k/v. The fresh
k/v are stored into the cache at slot_mapping (slots of -1 are skipped).

The cache may be narrower than q (kv_cache_dtype: float16, bfloat16): then every key and value,
the step's fresh ones included, is attended as the cache holds it (`as_cached`).

What differs between layers comes with each `forward` as a `LayerAttention`: the score scale,
a sliding window (query at position p sees keys p - window + 1 .. p, transformers'
`sliding_window`) and tanh soft-capping of the scores (Gemma 2).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention arithmetic: scores = softcap(scale * q.k), over the window."""

    scale: float
    window: int | None = None  # keys within `window` positions of the query (itself included)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"attention soft-cap must be > 0, got {self.softcap}")

    @staticmethod
    def plain(head_dim: int) -> LayerAttention:
        return LayerAttention(scale=head_dim**-0.5)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> object:
        """Per-step precomputation shared by all layers (gather indices, masks...)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], q's dtype or the kv_cache_dtype
        v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        meta: AttentionMetadata,
        prepared: object,
        layer: LayerAttention | None = None,  # None: LayerAttention.plain(D)
    ) -> torch.Tensor:  # [T, H, D]
        ...


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    valid: torch.Tensor | None,
) -> None:
    """Write this step's keys/values into the paged cache. `valid` selects tokens whose slot
    is not -1 (None = all are valid). A narrower cache (kv_cache_dtype) stores them rounded to
    nearest even."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, KVH, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if valid is None:
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)
    else:
        slots = slot_mapping[valid]
        k_flat.index_copy_(0, slots, k[valid])
        v_flat.index_copy_(0, slots, v[valid])


def as_cached(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's k/v as the cache holds them: rounded through a narrower kv_cache_dtype (and
    back), so every key is read alike, whether stored this step or an earlier one."""
    if k_cache.dtype == k.dtype:
        return k, v
    return k.to(k_cache.dtype).to(k.dtype), v.to(k_cache.dtype).to(v.dtype)


def get_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend `name` for activations of `dtype` over a KV cache of `kv_dtype` (None: dtype)."""
    kv_dtype = kv_dtype or dtype
    if name == "auto":
        # On CPU, the compiled paged kernel when a compiler is at hand (decode reads the cache
        # in place: ~3x faster steps at long contexts) and it takes these dtypes; else plain torch.
        if device.type == "cuda":
            name = "triton"
        else:
            from engine.attention.cpu_backend import cpu_kernel_available, cpu_kernel_dtypes

            refusal = cpu_kernel_dtypes(dtype, kv_dtype)
            if refusal is not None:
                print(f"[stepwise] attention_backend auto: torch, since {refusal}", file=sys.stderr)
            name = "cpu" if refusal is None and cpu_kernel_available() else "torch"
    elif name == "cpu":  # asked for by name (auto picks it only on CPU, for dtypes it takes)
        from engine.attention.cpu_backend import cpu_kernel_dtypes

        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' is a CPU kernel; this engine runs on {device.type} (use 'auto')")
        refusal = cpu_kernel_dtypes(dtype, kv_dtype)
        if refusal is not None:
            raise ValueError(f"attention_backend 'cpu': {refusal} (use 'auto' or 'torch')")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' runs on CUDA; this engine runs on {device.type} (use 'auto', "
                         "or TRITON_INTERPRET=1 to run its kernels interpreted on the CPU: slow, for tests)")
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttention

        return CpuAttention()
    if name == "torch":
        from engine.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")
