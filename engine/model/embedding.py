"""The token embedding: a dense table, or the GGUF blocks it is stored as.

When a GGUF model's embedding is stored in a type the native kernel reads (any of
quant_kernel.KERNEL_TYPES), tokens are looked up in its blocks instead of in an fp32 copy of
the table (V x E x 4 bytes: 113 MB for SmolLM2, 671 MB for Gemma 3 270M). With the LM head
tied to the embedding (SmolLM2, Gemma 3: Q8_0) the head keeps those blocks for its kernel
anyway, so the lookup costs no memory at all. Dequantizing a row is exact (see
quant_kernel.dequantize; the k-quants' and Q5_0's scale pairs are made for the looked-up rows),
so the rows equal the table transformers builds from the same file.
"""

from __future__ import annotations

import torch

from engine.model import quant_kernel
from engine.model.gguf_weights import QuantWeight


class Embedding:
    def __init__(self, table: torch.Tensor | None = None, blocks: QuantWeight | None = None):
        if (table is None) == (blocks is None):
            raise ValueError("an embedding is a dense table or GGUF blocks, exactly one of them")
        self.table = table  # [V, E]
        self.blocks = blocks  # [V, E/block weights * block bytes] uint8

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, E], a new tensor
        if self.table is not None:
            return self.table[input_ids]
        w = self.blocks
        return quant_kernel.dequantize(w.blocks[input_ids], w.qtype, scales=None if w.scales is None else w.scales[input_ids])
