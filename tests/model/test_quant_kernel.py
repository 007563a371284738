"""The GGUF block kernel: its dequantization equals the gguf package's bit for bit, and its
matmul equals dequantize-then-F.linear (~1e-5) on every code path this CPU can run, from the
blocks' own fp16 scales and from their fp32 copies (block_scales) alike; Q5_0 from its fp32
scales, and the k-quants (256-weight super-blocks) repacked as the kernel runs them (U4, I8, U8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize as gguf_dequantize

from engine.model import quant_kernel as qk

pytestmark = pytest.mark.skipif(not qk.quant_kernel_available(), reason="the C++ GGUF kernel does not build here")


def isa_param(isa: str):
    """The portable path runs everywhere; the others only on CPUs with their instructions."""
    if isa == "portable":
        return isa
    features = {"avx2": "AVX2 and FMA", "avx512": "AVX-512 F and BW"}[isa]
    return pytest.param(isa, marks=pytest.mark.skipif(not qk.isa_supported(isa), reason=f"this CPU lacks {features}"))


ISAS = [isa_param(i) for i in ("portable", "avx2", "avx512")]
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]
K_QUANTS = ["Q3_K", "Q4_K", "Q5_K", "Q6_K"]
SCALED = [pytest.param(False, id="fp16-scales"), pytest.param(True, id="fp32-scales")]


def scales_for(blocks: torch.Tensor, qtype: str, scaled: bool) -> torch.Tensor | None:
    """The blocks' fp32 scale pairs where the case asks for them (Q8_0 has none)."""
    return qk.block_scales(blocks, qtype) if scaled else None


def random_blocks(qtype: str, n: int, k: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    """[n, k/block weights * block bytes] uint8: random codes (and 6-bit or int8 sub-scales),
    random finite fp16 scales (and mins) of standard deviation `scale`."""
    rng = np.random.default_rng(seed)
    t = qk.KERNEL_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // t.weights, t.bytes), dtype=np.uint8)
    num_halves = 2 if qtype in ("Q4_1", "Q4_K", "Q5_K") else 1
    at = {"Q6_K": 208, "Q3_K": 108}.get(qtype, 0)  # Q6_K and Q3_K keep their d last
    halves = (rng.standard_normal((n, k // t.weights, num_halves)) * scale).astype(np.float16)
    raw[:, :, at : at + 2 * num_halves] = halves.view(np.uint8).reshape(n, k // t.weights, 2 * num_halves)
    return torch.from_numpy(raw.reshape(n, -1))


def reference_dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType[qtype]).astype(np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES + K_QUANTS)
@pytest.mark.parametrize("scaled", SCALED)
def test_dequantize_equals_gguf_exactly(qtype: str, isa: str, scaled: bool):
    k = 160 if qtype not in K_QUANTS else 768
    blocks = random_blocks(qtype, 37, k, seed=1)
    want = reference_dequantize(blocks, qtype)
    assert want.shape == (37, k)
    got = qk.dequantize(blocks, qtype, isa, scales_for(blocks, qtype, scaled))  # Q5_0 / k-quants: made when None
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_k_quant_scale_pairs_are_ggufs_sub_block_scales():
    from gguf.quants import Q4_K

    blocks = random_blocks("Q4_K", 3, 512, seed=3)
    raw = blocks.view(3, 2, 144).numpy()
    sc, mn = Q4_K.get_scale_min(raw[..., 4:16].reshape(6, 12))  # [6, 8] each
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32).reshape(6, 1)
    dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32).reshape(6, 1)
    pairs = qk.block_scales(blocks, "Q4_K").reshape(6, 8, 2).numpy()
    np.testing.assert_array_equal(pairs[..., 0], d * sc.astype(np.float32))
    np.testing.assert_array_equal(pairs[..., 1], -(dmin * mn.astype(np.float32)))
    six = random_blocks("Q6_K", 3, 256, seed=3)
    d6 = six[:, 208:210].contiguous().view(torch.float16).float()  # [3, 1]
    assert torch.equal(qk.block_scales(six, "Q6_K").reshape(3, 16), d6 * six[:, 192:208].contiguous().view(torch.int8).float())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_block_scales_are_each_blocks_pair_in_fp32(qtype: str):
    blocks = random_blocks(qtype, 5, 96, seed=2)
    scales = qk.block_scales(blocks, qtype)
    assert scales.shape == (5, 3, 2) and scales.dtype == torch.float32
    halves = blocks.view(5, 3, -1)[..., :4].contiguous().view(torch.float16).float()  # [5, 3, 2]: d and (Q4_1) m
    assert torch.equal(scales[..., 0], halves[..., 0])
    assert torch.equal(scales[..., 1], halves[..., 1] if qtype == "Q4_1" else -8 * halves[..., 0])
    assert qk.block_scales(random_blocks("Q8_0", 5, 96, seed=2), "Q8_0") is None


# K = 96 and 608 are multiples of the block (32) but not of the vector tiles (64 at AVX-512 x 4).
# Rows: 1-3 direct; from 4, panels of 24 weight rows (n: whole panels and ragged ones), by dot
# products below one vector of rows (7; 12 on AVX-512), else by outer products on strips of
# 4 / 8 / 16 rows in tiles of two (12, 20, 300: a part-filled last tile; 161: one strip of 1 row).
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 33, 96), (2, 50, 608), (3, 17, 160), (7, 70, 96), (12, 48, 96), (20, 53, 608),
                                      (64, 31, 224), (161, 19, 96), (300, 45, 608)])
@pytest.mark.parametrize("scaled", SCALED)
def test_matmul_equals_dequantize_then_linear(qtype: str, isa: str, rows: int, n: int, k: int, scaled: bool):
    blocks = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, reference_dequantize(blocks, qtype))
    got = qk.matmul(x, blocks, qtype, isa, scales_for(blocks, qtype, scaled))
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# The k-quants' K is a multiple of their 256-weight super-block; the same row counts and paths,
# on the form the kernel runs them in (matmul repacks them first: U4, I8, U8).
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("rows,n,k", [(1, 33, 256), (2, 50, 768), (3, 17, 512), (7, 70, 256), (12, 48, 256),
                                      (20, 53, 768), (64, 31, 256), (161, 19, 512), (300, 45, 768)])
def test_k_quant_matmul_equals_dequantize_then_linear(qtype: str, isa: str, rows: int, n: int, k: int):
    blocks = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, reference_dequantize(blocks, qtype))
    got = qk.matmul(x, blocks, qtype, isa)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# The forms models run the k-quants in (repack): every weight still gguf's, on every path.
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", K_QUANTS)
def test_repacked_k_quants_dequantize_to_ggufs_weights(qtype: str, isa: str):
    blocks = random_blocks(qtype, 37, 768, seed=4)
    packed, packed_type, scales = qk.repack(blocks, qtype)
    assert packed_type == qk.REPACKED[qtype] and packed.shape == (37, 768 // 32 * qk.KERNEL_TYPES[packed_type].bytes)
    assert torch.equal(scales, qk.block_scales(blocks, qtype))
    torch.testing.assert_close(qk.dequantize(packed, packed_type, isa, scales), reference_dequantize(blocks, qtype),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="codes only"):
        qk.block_scales(packed, packed_type)
    with pytest.raises(RuntimeError, match="run only with their fp32 scales"):
        torch.ops.stepwise_gguf.dequantize(packed, qk.KERNEL_TYPES[packed_type].id, 768, 0, torch.empty(37, 768), None)


def test_matmul_accepts_a_strided_row_view():
    blocks = random_blocks("Q4_1", 20, 64, seed=5)
    x = torch.randn(9, 64)
    want = F.linear(x[::2], reference_dequantize(blocks, "Q4_1"))
    torch.testing.assert_close(qk.matmul(x[::2], blocks, "Q4_1"), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_k_quants_given_scales_are_used(qtype):
    """The scales a caller passes for a k-quant are the ones applied, never silently replaced by repack's."""
    blocks, x = random_blocks(qtype, 6, 256, seed=8), torch.randn(3, 256)
    doubled = 2 * qk.block_scales(blocks, qtype)
    torch.testing.assert_close(qk.matmul(x, blocks, qtype, scales=doubled), 2 * qk.matmul(x, blocks, qtype))
    torch.testing.assert_close(qk.dequantize(blocks, qtype, scales=doubled), 2 * qk.dequantize(blocks, qtype))


def test_bad_inputs_are_refused():
    blocks = random_blocks("Q8_0", 4, 64, seed=6)
    with pytest.raises(RuntimeError, match="hold K"):
        qk.matmul(torch.randn(2, 64), blocks[:, :-1].contiguous(), "Q8_0")
    with pytest.raises(RuntimeError, match="x must be float32"):
        qk.matmul(torch.randn(2, 32), blocks, "Q8_0")
    q4 = random_blocks("Q4_1", 4, 64, seed=6)
    with pytest.raises(RuntimeError, match="Q8_0 blocks take no fp32 scales"):
        qk.matmul(torch.randn(2, 64), blocks, "Q8_0", scales=torch.zeros(4, 2, 2))
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float32 \[N, K/32, 2\] = \[4, 2, 2\]"):
        qk.matmul(torch.randn(2, 64), q4, "Q4_1", scales=qk.block_scales(q4, "Q4_1")[:3])
    with pytest.raises(ValueError, match="unknown kernel path"):
        qk.isa_supported("neon")
    ops, k4 = torch.ops.stepwise_gguf, random_blocks("Q4_K", 4, 256, seed=6)
    with pytest.raises(RuntimeError, match="unsupported ggml type 12 .*the k-quants run repacked"):
        ops.matmul(torch.randn(2, 256), k4, 12, 256, 0, torch.empty(2, 4))  # stored Q4_K: qk.matmul repacks it
    u4 = qk.repack(k4, "Q4_K")[0]
    with pytest.raises(RuntimeError, match="type 100 run only with their fp32 scales"):
        ops.matmul(torch.randn(2, 256), u4, 100, 256, 0, torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="K = 48 is not a multiple of the block size 32"):
        ops.matmul(torch.randn(2, 48), u4[:, :24].contiguous(), 100, 48, 0, torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="type 6 has no int8 kernel"):
        qk.matmul_q8(torch.randn(2, 64), random_blocks("Q5_0", 4, 64, seed=6), "Q5_0")


def test_best_isa_is_one_this_cpu_runs():
    assert qk.isa_supported(qk.best_isa())
    assert qk.isa_supported("portable")
