"""The token embedding: a dense table, or the GGUF blocks it is stored as.

A GGUF model ties its LM head to the embedding (SmolLM2: Q8_0), and the LM head keeps those
blocks for the native kernel anyway; looking tokens up in them instead of in an fp32 copy of
the table spares that copy (V x E x 4 bytes: 113 MB for SmolLM2). Dequantizing a row is exact
(an fp16 scale times a small integer, see quant_kernel.dequantize), so the rows equal the
table transformers builds from the same file.
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
