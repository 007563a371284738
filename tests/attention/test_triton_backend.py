"""TritonAttention against TorchAttention (and a per-token naive reference) on small paged
batches, run through the Triton interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from engine.attention.backend import LayerAttention  # noqa: E402
from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttention
from tests.attention.batches import make_batch  # noqa: E402
from engine.attention.triton_backend import TritonAttention  # noqa: E402

H, KVH, D, BS, NUM_BLOCKS = 4, 2, 16, 4, 32


def naive(q, k, v, k_cache, v_cache, meta):
    """Token-by-token reference; reads cached keys from the cache *before* this step's store."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        table = meta.block_tables[i].long()
        pos = torch.arange(ctx)
        slots = table[pos // BS] * BS + pos % BS
        kc = k_cache.view(-1, KVH, D)[slots]  # [ctx, KVH, D]
        vc = v_cache.view(-1, KVH, D)[slots]
        for j in range(q_len):
            rows = slice(starts[i], starts[i] + j + 1)
            ks = torch.cat([kc, k[rows]]).repeat_interleave(H // KVH, dim=1)  # [ctx+j+1, H, D]
            vs = torch.cat([vc, v[rows]]).repeat_interleave(H // KVH, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[starts[i] + j], ks) / D**0.5
            out[starts[i] + j] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vs)
    return out


def run_both(seqs, block_n=16, seed=0, cache_dtype=None):
    meta, q, k, v, k_cache, v_cache = make_batch(seqs, heads=(H, KVH), d=D, bs=BS, seed=seed, num_blocks=NUM_BLOCKS,
                                                 cache_dtype=cache_dtype)
    # a narrower cache: every key is attended as stored, so the naive reference rounds the fresh ones
    expected_naive = naive(q, *(x.to(k_cache.dtype).float() for x in (k, v, k_cache, v_cache)), meta)
    kc_t, vc_t = k_cache.clone(), v_cache.clone()
    torch_be = TorchAttention()
    ref = torch_be.forward(q, k, v, kc_t, vc_t, meta, torch_be.prepare(meta))
    kc_x, vc_x = k_cache.clone(), v_cache.clone()
    triton_be = TritonAttention(block_n=block_n)
    out = triton_be.forward(q, k, v, kc_x, vc_x, meta, triton_be.prepare(meta))
    return dict(meta=meta, k=k, v=v, cache0=(k_cache, v_cache), ref=ref, naive=expected_naive,
                out=out, torch_cache=(kc_t, vc_t), triton_cache=(kc_x, vc_x))


def check_outputs(r):
    assert r["out"].shape == r["ref"].shape and r["out"].dtype == r["ref"].dtype
    torch.testing.assert_close(r["out"], r["ref"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r["out"], r["naive"], atol=1e-4, rtol=1e-4)


PREFILL = [(0, 7, False), (5, 6, False)]
DECODES = [(c, 1, False) for c in (1, 4, 9, 13, 3)]
MIXED = [(0, 5, False), (6, 3, False)] + DECODES + [(0, 3, True)]


@pytest.mark.parametrize("block_n", [16, 4])
def test_prefill_chunks(block_n):
    check_outputs(run_both(PREFILL, block_n, seed=1))


@pytest.mark.parametrize("block_n", [16, 4])
def test_decodes(block_n):
    check_outputs(run_both(DECODES, block_n, seed=2))


@pytest.mark.parametrize("block_n", [16, 4])
def test_mixed_with_padding(block_n):
    check_outputs(run_both(MIXED, block_n, seed=3))


def test_cache_store_matches_torch():
    r = run_both(MIXED, seed=4)
    for got, want in zip(r["triton_cache"], r["torch_cache"]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    # Stored slots hold this step's k/v; every other slot (incl. padding's) is untouched.
    slots = r["meta"].slot_mapping
    valid = slots >= 0
    for got, fresh, before in zip(r["triton_cache"], (r["k"], r["v"]), r["cache0"]):
        flat, flat0 = got.view(-1, KVH, D), before.view(-1, KVH, D)
        torch.testing.assert_close(flat[slots[valid]], fresh[valid], atol=0, rtol=0)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[valid]] = False
        torch.testing.assert_close(flat[untouched], flat0[untouched], atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_narrow_cache(cache_dtype):
    """kv_cache_dtype: the kernel widens fp16/bf16 cache rows on load and attends the step's
    fresh rows rounded alike; both backends store the same rounded rows."""
    r = run_both(MIXED, seed=5, cache_dtype=cache_dtype)
    check_outputs(r)
    for got, want in zip(r["triton_cache"], r["torch_cache"]):
        assert got.dtype == cache_dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_empty_batch():
    meta = AttentionMetadata.build([], [], [], [], BS)
    be = TritonAttention()
    q = torch.empty(0, H, D)
    kv = torch.empty(0, KVH, D)
    cache = torch.zeros(NUM_BLOCKS, BS, KVH, D)
    assert be.forward(q, kv, kv, cache, cache.clone(), meta, be.prepare(meta)).shape == (0, H, D)


@pytest.mark.parametrize("head_dim", [24, 48, 96])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, 5.0)])
def test_head_dim_not_a_power_of_two(head_dim, window, softcap):
    """Phi-3-mini's 96, a supported family: the kernel asserted a power of two at the first
    request, so every request failed. Its tile is now the next power, the lanes past head_dim masked."""
    meta, q, k, v, k_cache, v_cache = make_batch(MIXED, heads=(H, KVH), d=head_dim, bs=BS, num_blocks=NUM_BLOCKS)
    layer = LayerAttention(scale=head_dim**-0.5, window=window, softcap=softcap)
    caches = {}
    for backend in (TorchAttention(), TritonAttention()):
        kc, vc = k_cache.clone(), v_cache.clone()
        caches[backend.name] = (backend.forward(q, k, v, kc, vc, meta, backend.prepare(meta), layer), kc, vc)
    for ref, out in zip(caches["torch"], caches["triton"]):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
