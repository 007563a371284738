"""Per-layer attention arithmetic in every backend: score scale, sliding window and tanh
soft-capping, against a token-by-token reference written from transformers' eager attention
(scores * scale, soft-cap, mask keys at or before p - window, softmax)."""

import pytest
import torch

from engine.attention.backend import LayerAttention
from engine.attention.torch_backend import TorchAttention
from tests.attention.batches import make_batch

H, KVH, D, BS = 4, 2, 16, 4
# fresh prompts, cached chunks (8-token tiles and 16-key chunks crossing the window's start),
# decodes at contexts around the window and block edges, padding
SEQS = [(0, 7, False), (5, 6, False), (16, 21, False), (3, 1, False), (33, 1, False), (64, 1, False),
        (17, 1, False), (0, 3, True), (10, 40, False), (0, 37, False)]
# the Triton interpreter runs one program per (token, head) in Python: a smaller batch that still
# crosses the window's start in cached context, fresh keys and 16-key tiles
SEQS_TRITON = [(5, 6, False), (17, 1, False), (20, 12, False), (0, 3, True)]
LAYERS = {
    "plain": LayerAttention.plain(D),
    "window-5": LayerAttention(0.3, window=5),
    "window-1": LayerAttention(0.3, window=1),
    "window-17-softcap": LayerAttention(0.2, window=17, softcap=3.0),
    "window-past-context": LayerAttention(0.25, window=1000),
    "softcap": LayerAttention(0.25, softcap=1.5),
}


def reference(q, k, v, k_cache, v_cache, meta, layer: LayerAttention) -> torch.Tensor:
    """Token by token; cached keys are read from the cache before this step's store."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        pos = torch.arange(ctx)
        slots = meta.block_tables[i].long()[pos // BS] * BS + pos % BS
        kc, vc = k_cache.view(-1, KVH, D)[slots], v_cache.view(-1, KVH, D)[slots]  # [ctx, KVH, D]
        for j in range(q_len):
            rows = slice(starts[i], starts[i] + j + 1)
            ks = torch.cat([kc, k[rows]]).repeat_interleave(H // KVH, dim=1)  # [ctx+j+1, H, D]
            vs = torch.cat([vc, v[rows]]).repeat_interleave(H // KVH, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[starts[i] + j], ks) * layer.scale  # [H, ctx+j+1]
            if layer.softcap is not None:
                scores = torch.tanh(scores / layer.softcap) * layer.softcap
            if layer.window is not None:
                scores[:, : max(0, ctx + j - layer.window + 1)] = float("-inf")
            out[starts[i] + j] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vs)
    return out


def backend(name: str):
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttention, cpu_kernel_available

        if not cpu_kernel_available():
            pytest.skip("CPU attention kernel cannot be built here")
        return CpuAttention()
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttention

    return TritonAttention()


@pytest.mark.parametrize("layer", LAYERS.values(), ids=LAYERS.keys())
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_matches_reference(name, layer):
    be = backend(name)
    seqs = SEQS_TRITON if name == "triton" else SEQS
    meta, q, k, v, k_cache, v_cache = make_batch(seqs, heads=(H, KVH), d=D, bs=BS, num_blocks=96)
    want = reference(q, k, v, k_cache, v_cache, meta, layer)
    got = be.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, be.prepare(meta), layer)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_window_changes_the_result(name):
    """The window is not a no-op: a long prompt's last tokens attend differently with it."""
    be = backend(name)
    meta, q, k, v, k_cache, v_cache = make_batch([(20, 12, False)], heads=(H, KVH), d=D, bs=BS, num_blocks=64)
    full = be.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, be.prepare(meta), LAYERS["plain"])
    windowed = be.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, be.prepare(meta),
                          LayerAttention(LAYERS["plain"].scale, window=8))
    assert (full - windowed).abs().max() > 1e-2


def test_bad_layer_values_are_refused():
    with pytest.raises(ValueError, match="window"):
        LayerAttention(0.1, window=0)
    with pytest.raises(ValueError, match="soft-cap"):
        LayerAttention(0.1, softcap=-1.0)
