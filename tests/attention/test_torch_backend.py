"""TorchAttention's decode workspace over a narrow KV cache (kv_cache_dtype): rows are widened
into a reused buffer, and the result is the one a float32 cache holding the same values gives."""

from __future__ import annotations

import torch

from engine.attention.torch_backend import TorchAttention
from tests.attention.batches import make_batch

DECODES = [(c, 1, False) for c in (1, 4, 5, 17, 33, 64)]


def test_narrow_cache_decodes_through_reused_workspaces():
    meta, q, k, v, k_cache, v_cache = make_batch(DECODES, cache_dtype=torch.float16)
    k, v = k.half().float(), v.half().float()  # fresh rows the cache stores exactly
    wide = TorchAttention()
    want = wide.forward(q, k, v, k_cache.float(), v_cache.float(), meta, wide.prepare(meta))

    be = TorchAttention()
    got = be.forward(q, k, v, k_cache, v_cache, meta, be.prepare(meta))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert set(be._workspaces) == {torch.float16, torch.float32}
    held = {dtype: ws.data_ptr() for dtype, ws in be._workspaces.items()}
    again = be.forward(q, k, v, k_cache, v_cache, meta, be.prepare(meta))
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert {dtype: ws.data_ptr() for dtype, ws in be._workspaces.items()} == held  # no buffer made afresh
