"""The paged KV cache: one preallocated tensor, owned by the step executor.

Layout [layers, 2, num_blocks, block_size, kv_heads, head_dim]: a block is `block_size`
consecutive positions of one sequence; a token's slot is block * block_size + offset.
The block manager decides which blocks belong to whom; this module only holds the memory.
Its element type is the model's dtype, or a narrower `kv_cache_dtype` (float16, bfloat16) that
the attention backends store keys and values into rounded (engine/attention/backend.py).
"""

from __future__ import annotations

import torch

from engine import memory

HEADROOM = 0.9  # the most of the free memory a pool may take: the rest is for the steps' activations


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        _require_fits(num_blocks, num_layers * 2 * block_size * num_kv_heads * head_dim, dtype, torch.device(device))
        # zeros, not empty: pages are touched now, so RSS at start shows the real footprint
        self.data = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, KVH, D]."""
        return self.data[i, 0], self.data[i, 1]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's keys and values, every layer (copy-on-write of a
        block forked sequences shared). The dst blocks are fresh: no dst is another's src."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.data.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]  # [L, 2, C, block_size, KVH, D]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _require_fits(num_blocks: int, block_elements: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, naming num_blocks, a pool larger than the memory free for it: zeroing it would
    otherwise end in the OOM killer (no message) or in swap."""
    free, block_bytes = memory.available_bytes(device), block_elements * dtype.itemsize
    if free is None or num_blocks * block_bytes <= HEADROOM * free:
        return
    hint = " (kv_cache_dtype = \"float16\" halves a block)" if dtype.itemsize == 4 else ""
    raise ValueError(f"[cache] num_blocks = {num_blocks} needs {num_blocks * block_bytes / 2**30:.1f} GiB for the KV pool "
                     f"({block_bytes / 2**20:.2f} MiB a block), but {device.type} has {free / 2**30:.1f} GiB free: "
                     f"set num_blocks to at most {int(HEADROOM * free // block_bytes)}{hint}")
