"""Test helper: drive LlamaModel directly with a trivial block allocator (no scheduler)."""

from __future__ import annotations

import torch

from engine.batch import Seq, flatten_batch
from engine.kv_cache import KVCache
from engine.model.llama import LlamaModel


class PagedRunner:
    def __init__(self, model: LlamaModel, num_blocks: int = 256, block_size: int = 16, kv_dtype: torch.dtype | None = None):
        s = model.shape
        self.model = model
        self.block_size = block_size
        self.cache = KVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, kv_dtype or model.dtype)
        # hand out blocks in a scrambled order so contiguity is never assumed
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist())
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _grow(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < length:
            table.append(self.free.pop())
        return list(table)

    def step(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        """items: (seq id, new token ids) in batch order. Returns last-token logits [B, V]."""
        seqs = []
        for seq, toks in items:
            ctx = self.lens.get(seq, 0)
            seqs.append(Seq(toks, ctx, self._grow(seq, ctx + len(toks))))
            self.lens[seq] = ctx + len(toks)
        b = flatten_batch(seqs, self.block_size)
        return self.model.forward(b.input_ids, b.positions, b.meta, self.cache, torch.tensor(b.logits_rows))

    def greedy(self, seq: int, prompt: list[int], n: int, chunk: int | None = None) -> list[int]:
        chunk = chunk or len(prompt)
        for i in range(0, len(prompt), chunk):
            logits = self.step([(seq, prompt[i : i + chunk])])
        out = [int(logits[0].argmax())]
        for _ in range(n - 1):
            out.append(int(self.step([(seq, [out[-1]])])[0].argmax()))
        return out
