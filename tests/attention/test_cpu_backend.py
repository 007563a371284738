"""CpuAttention (the C++ paged-attention kernel) against TorchAttention on small paged batches,
plus greedy parity with transformers on the real model. Skipped where the kernel cannot be
built (no compiler / ninja)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attention.cpu_backend import CpuAttention, cpu_kernel_available
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttention
from engine.cpu import RESTRICT_ENV, cpu_info
from tests.attention.batches import make_batch

if not cpu_kernel_available():
    pytest.skip("CPU attention kernel cannot be built here", allow_module_level=True)

NUM_BLOCKS = 128
REPO = Path(__file__).resolve().parents[2]


def run_both(seqs, tokens_per_tile=8, **kw):
    meta, q, k, v, k_cache, v_cache = make_batch(seqs, **kw)
    caches = {}
    outs = {}
    for be in (TorchAttention(), CpuAttention(tokens_per_tile)):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[be.name] = be.forward(q, k, v, kc, vc, meta, be.prepare(meta))
        caches[be.name] = (kc, vc)
    return outs, caches


def check(seqs, atol=1e-5, **kw):
    outs, caches = run_both(seqs, **kw)
    assert outs["cpu"].shape == outs["torch"].shape and outs["cpu"].dtype == outs["torch"].dtype
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=atol, rtol=atol)
    for got, want in zip(caches["cpu"], caches["torch"]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


PREFILL_FRESH = [(0, 7, False), (0, 19, False), (0, 1, False)]
PREFILL_CACHED = [(5, 6, False), (16, 21, False), (3, 1, False)]
DECODES = [(c, 1, False) for c in (1, 3, 4, 5, 9, 15, 16, 17, 33, 64)]  # crossing 4/16 blocks
MIXED = [(0, 5, False), (6, 3, False)] + DECODES + [(0, 3, True), (0, 1, True)]


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("heads", [(6, 2), (3, 1), (4, 4)], ids=["gqa3", "gqa3-kvh1", "mha"])
@pytest.mark.parametrize("seqs", [PREFILL_FRESH, PREFILL_CACHED, DECODES, MIXED],
                         ids=["prefill-fresh", "prefill-cached", "decodes", "mixed-padding"])
def test_matches_torch(seqs, heads, bs):
    check(seqs, heads=heads, bs=bs)


@pytest.mark.parametrize("d", [64, 128, 20, 4])  # specialised D; generic D, with a tail past 8 lanes
def test_head_dims(d):
    check(MIXED, d=d, bs=16)


@pytest.mark.parametrize("tokens_per_tile", [1, 3, 32])
def test_tile_sizes(tokens_per_tile):
    check(MIXED + [(10, 40, False)], tokens_per_tile=tokens_per_tile)


def test_threads_one_and_many():
    before = torch.get_num_threads()
    try:
        for n in (1, max(2, before)):
            torch.set_num_threads(n)
            check(MIXED)
    finally:
        torch.set_num_threads(before)


def test_bfloat16():
    check(MIXED, dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float16)], ids=["f32-f16", "f32-bf16", "bf16-f16"])
@pytest.mark.parametrize("d", [64, 20])  # the vector loads, and a tail of D past 8 lanes
def test_narrow_cache_matches_torch(dtype, cache_dtype, d):
    """A kv_cache_dtype narrower than q: both backends store the same rounded rows (bit-equal
    caches) and read them back widened, so their outputs agree as closely as for one dtype."""
    check(MIXED, d=d, dtype=dtype, cache_dtype=cache_dtype, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(not cpu_info().has("fma"), reason="this CPU lacks FMA: no restricted build to make")
def test_narrow_cache_without_f16c():
    """A build without F16C (STEPWISE_CPU_FEATURES=fma: -mfma only) converts fp16 rows with c10's
    scalar code instead of vcvtph2ps / vcvtps2ph; it must store and read the same values."""
    code = ("import torch; from tests.attention.test_cpu_backend import MIXED, check\n"
            "for d in (64, 20): check(MIXED, d=d, cache_dtype=torch.float16)\nprint('narrow ok')")
    env = {**os.environ, RESTRICT_ENV: "fma"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "narrow ok" in run.stdout, run.stderr[-3000:]


def test_narrow_cache_is_close_to_a_full_one():
    """What the rounding costs: fp16 keys/values (10-bit mantissa) against the float32 cache."""
    meta, q, k, v, k_cache, v_cache = make_batch(MIXED, d=64, seed=3)
    be = CpuAttention()
    want = be.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, be.prepare(meta))
    kc, vc = k_cache.half(), v_cache.half()
    got = be.forward(q, k, v, kc, vc, meta, be.prepare(meta))
    assert kc.dtype == torch.float16
    assert not torch.equal(got, want)  # the cached context really was read at fp16
    torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)


def test_padding_only_and_empty_batch():
    check([(0, 4, True)])
    meta = AttentionMetadata.build([], [], [], [], 4)
    be = CpuAttention()
    q, kv = torch.empty(0, 6, 16), torch.empty(0, 2, 16)
    cache = torch.zeros(NUM_BLOCKS, 4, 2, 16)
    assert be.forward(q, kv, kv, cache, cache.clone(), meta, be.prepare(meta)).shape == (0, 6, 16)


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    meta, q, k, v, k_cache, v_cache = make_batch(DECODES, seed=6)
    be = CpuAttention()
    plan = be.prepare(meta)
    plan.block_tables = plan.block_tables.clone()
    plan.block_tables[3, 0] = NUM_BLOCKS  # block id past the cache
    with pytest.raises(RuntimeError, match="bad block id"):
        be.forward(q, k, v, k_cache, v_cache, meta, plan)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        be.forward(q.half(), k.half(), v.half(), k_cache.half(), v_cache.half(), meta, be.prepare(meta))
    with pytest.raises(RuntimeError, match="cannot use a Float KV cache"):  # wider than q: not a kv_cache_dtype
        be.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), k_cache, v_cache, meta, be.prepare(meta))
    with pytest.raises(RuntimeError, match="so must the caches"):
        be.forward(q, k, v, k_cache, v_cache.half(), meta, be.prepare(meta))


def test_cache_views_of_one_big_tensor():
    """Per-layer caches are views of one [layers, 2, ...] tensor, as in KVCache."""
    meta, q, k, v, k_cache, v_cache = make_batch(MIXED, seed=5)
    big = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # [2 layers, 2, N, bs, KVH, D]
    ref = TorchAttention()
    want = ref.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, ref.prepare(meta))
    be = CpuAttention()
    got = be.forward(q, k, v, big[1, 0], big[1, 1], meta, be.prepare(meta))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.real_model
def test_greedy_matches_hf_generate(real_model):
    from engine.model.llama import LlamaModel
    from tests.paged import PagedRunner

    model = LlamaModel(real_model.hf_model, CpuAttention())
    tok = real_model.tokenizer
    for text in ("The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"):
        prompt = tok(text)["input_ids"]
        with torch.inference_mode():
            hf = real_model.hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id,
            )[0, len(prompt):].tolist()
        ours = PagedRunner(model, num_blocks=32, block_size=4).greedy(0, prompt, 24, chunk=3)
        eos = real_model.hf_model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        ours = ours[: ours.index(eos) + 1] if eos in ours else ours
        assert ours == hf, f"ours: {tok.decode(ours)!r}\nhf:   {tok.decode(hf)!r}"
