"""The GGUF block kernel: its dequantization equals the gguf package's bit for bit, and its
matmul equals dequantize-then-F.linear (~1e-5) on every code path this CPU can run, from the
blocks' own fp16 scales and from their fp32 copies (block_scales) alike."""

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
TYPES = ["Q4_0", "Q4_1", "Q8_0"]
SCALED = [pytest.param(False, id="fp16-scales"), pytest.param(True, id="fp32-scales")]


def scales_for(blocks: torch.Tensor, qtype: str, scaled: bool) -> torch.Tensor | None:
    """The blocks' fp32 scale pairs where the case asks for them (Q8_0 has none)."""
    return qk.block_scales(blocks, qtype) if scaled else None


def random_blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k/32 * block bytes] uint8: random codes, random finite fp16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    nbytes = qk.KERNEL_TYPES[qtype][1]
    raw = rng.integers(0, 256, size=(n, k // 32, nbytes), dtype=np.uint8)
    num_halves = 2 if qtype == "Q4_1" else 1
    halves = (rng.standard_normal((n, k // 32, num_halves)) * 0.05).astype(np.float16)
    raw[:, :, : 2 * num_halves] = halves.view(np.uint8).reshape(n, k // 32, 2 * num_halves)
    return torch.from_numpy(raw.reshape(n, -1))


def reference_dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType[qtype]).astype(np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("scaled", SCALED)
def test_dequantize_equals_gguf_exactly(qtype: str, isa: str, scaled: bool):
    blocks = random_blocks(qtype, 37, 160, seed=1)
    want = reference_dequantize(blocks, qtype)
    assert want.shape == (37, 160)
    got = qk.dequantize(blocks, qtype, isa, scales_for(blocks, qtype, scaled))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


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


def test_matmul_accepts_a_strided_row_view():
    blocks = random_blocks("Q4_1", 20, 64, seed=5)
    x = torch.randn(9, 64)
    want = F.linear(x[::2], reference_dequantize(blocks, "Q4_1"))
    torch.testing.assert_close(qk.matmul(x[::2], blocks, "Q4_1"), want, rtol=1e-5, atol=1e-5)


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


def test_best_isa_is_one_this_cpu_runs():
    assert qk.isa_supported(qk.best_isa())
    assert qk.isa_supported("portable")
