"""The token embedding: a dense table, or the GGUF blocks it is stored as.

When a GGUF model's embedding is stored in a type the native kernel reads (Q4_0, Q4_1, Q8_0),
tokens are looked up in its blocks instead of in an fp32 copy of the table (V x E x 4 bytes:
113 MB for SmolLM2). With the LM head tied to the embedding (SmolLM2: Q8_0) the head keeps
those blocks for its kernel anyway, so the lookup costs no memory at all. Dequantizing a row is
exact (an fp16 scale times a small integer, see quant_kernel.dequantize), so the rows equal
the table transformers builds from the same file.
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
        self.blocks = blocks  # [V, E/32 * block bytes] uint8

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, E], a new tensor
        if self.table is not None:
            return self.table[input_ids]
        return quant_kernel.dequantize(self.blocks.blocks[input_ids], self.blocks.qtype)
