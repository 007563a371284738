"""The GGUF block kernel: its dequantization equals the gguf package's bit for bit, and its
matmul equals dequantize-then-F.linear (~1e-5) on every code path this CPU can run."""

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
def test_dequantize_equals_gguf_exactly(qtype: str, isa: str):
    blocks = random_blocks(qtype, 37, 160, seed=1)
    want = reference_dequantize(blocks, qtype)
    assert want.shape == (37, 160)
    torch.testing.assert_close(qk.dequantize(blocks, qtype, isa), want, rtol=0, atol=0)


# K = 96 and 608 are multiples of the block (32) but not of the vector tiles (64 at AVX-512 x 4)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 33, 96), (2, 50, 608), (3, 17, 160), (7, 70, 96), (64, 31, 224),
                                      (161, 19, 96), (300, 45, 608)])
def test_matmul_equals_dequantize_then_linear(qtype: str, isa: str, rows: int, n: int, k: int):
    blocks = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, reference_dequantize(blocks, qtype))
    got = qk.matmul(x, blocks, qtype, isa)
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
    with pytest.raises(ValueError, match="unknown kernel path"):
        qk.isa_supported("neon")


def test_best_isa_is_one_this_cpu_runs():
    assert qk.isa_supported(qk.best_isa())
    assert qk.isa_supported("portable")
