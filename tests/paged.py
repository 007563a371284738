"""Test helper: drive LlamaModel directly with a trivial block allocator (no scheduler)."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model.llama import LlamaModel


class PagedRunner:
    def __init__(self, model: LlamaModel, num_blocks: int = 256, block_size: int = 16):
        s = model.shape
        self.model = model
        self.block_size = block_size
        self.cache = KVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, model.embed.dtype)
        # hand out blocks in a scrambled order so contiguity is never assumed
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist())
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slots(self, seq: int, start: int, n: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < start + n:
            table.append(self.free.pop())
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, start + n)]

    def step(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        """items: (seq id, new token ids) in batch order. Returns last-token logits [B, V]."""
        ids, pos, slots, qlens, ctxs, tables, rows = [], [], [], [], [], [], []
        for seq, toks in items:
            ctx = self.lens.get(seq, 0)
            ids += toks
            pos += list(range(ctx, ctx + len(toks)))
            slots += self._slots(seq, ctx, len(toks))
            qlens.append(len(toks))
            ctxs.append(ctx)
            tables.append(list(self.tables[seq]))
            rows.append(len(ids) - 1)
            self.lens[seq] = ctx + len(toks)
        meta = AttentionMetadata.build(qlens, ctxs, tables, slots, self.block_size)
        return self.model.forward(torch.tensor(ids), torch.tensor(pos), meta, self.cache, torch.tensor(rows))

    def greedy(self, seq: int, prompt: list[int], n: int, chunk: int | None = None) -> list[int]:
        chunk = chunk or len(prompt)
        for i in range(0, len(prompt), chunk):
            logits = self.step([(seq, prompt[i : i + chunk])])
        out = [int(logits[0].argmax())]
        for _ in range(n - 1):
            out.append(int(self.step([(seq, [out[-1]])])[0].argmax()))
        return out
