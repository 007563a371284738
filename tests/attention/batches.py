"""Random attention batches shared by the backend tests: any mix of fresh prefills, cached
chunks, decodes and padding, over a random paged cache with shuffled block ids."""

from __future__ import annotations

import torch

from engine.batch import Seq, flatten_batch


def make_batch(seqs, heads=(6, 2), d=16, bs=4, dtype=torch.float32, seed=0, num_blocks=128, cache_dtype=None):
    """seqs: (context_len, query_len, is_padding). Blocks come from a shuffled pool, so block
    ids are non-contiguous and out of order. Returns metadata, q/k/v and a random cache (of
    `cache_dtype`, None = dtype)."""
    h, kvh = heads
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    batch = []
    for ctx, q_len, pad in seqs:
        table = [] if pad else [pool.pop() for _ in range(-(-(ctx + q_len) // bs))]
        batch.append(Seq([0] * q_len, ctx, table, num_padding=q_len if pad else 0))
    meta = flatten_batch(batch, bs).meta
    t = meta.num_tokens
    q = torch.randn(t, h, d, generator=gen).to(dtype)  # [T, H, D]
    k = torch.randn(t, kvh, d, generator=gen).to(dtype)  # [T, KVH, D]
    v = torch.randn(t, kvh, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(cache_dtype or dtype)  # [N, bs, KVH, D]
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(cache_dtype or dtype)
    return meta, q, k, v, k_cache, v_cache
