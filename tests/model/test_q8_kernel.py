"""The int8-activation GGUF kernel (weight_format "gguf-q8"): its activation codes equal a torch
quantization bit for bit, its matmul equals the same quantized math done in torch (~1e-5) on
every code path this CPU can run, and stays within the activations' rounding of fp32 F.linear;
QuantLinear runs it up to max_rows rows and the dense copy above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import quant_kernel as qk
from engine.model.gguf_weights import QuantWeight
from engine.model.linear import Linear
from engine.model.quant_linear import QuantLinear
from tests.model.test_quant_kernel import ISAS, random_blocks, reference_dequantize

TYPES = list(qk.Q8_TYPES)  # what the int8 kernel runs

pytestmark = pytest.mark.skipif(not qk.quant_kernel_available(), reason="the C++ GGUF kernel does not build here")


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, K] -> codes [T, K/32, 32], d [T, K/32], d * sum(codes) [T, K/32], as llama.cpp's Q8_0."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(xb / d[..., None]), torch.zeros(()))
    return q, d, d * q.sum(-1)


def weight_codes(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks -> codes [N, K/32, 32] (Q4_0: nibble - 8; Q4_1: the nibble), d and m [N, K/32]."""
    raw = blocks.reshape(blocks.shape[0], -1, qk.KERNEL_TYPES[qtype][1])
    half = lambda lo: raw[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()  # noqa: E731
    if qtype == "Q8_0":
        return raw[..., 2:].contiguous().view(torch.int8).float(), half(0), torch.zeros(())
    nib = raw[..., 4:] if qtype == "Q4_1" else raw[..., 2:]
    codes = torch.cat([nib & 15, nib >> 4], -1).float()
    return (codes, half(0), half(2)) if qtype == "Q4_1" else (codes - 8, half(0), torch.zeros(()))


def reference_matmul_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The kernel's math in float64: sum over blocks of dx dw (integer dot) + m * dx sum(qx)."""
    qx, dx, sx = (t.double() for t in reference_quantize(x))
    qw, dw, mw = (t.double() for t in weight_codes(blocks, qtype))
    dots = torch.einsum("tbj,nbj->tnb", qx, qw)  # exact: integers below 2^53
    y = torch.einsum("tnb,tb,nb->tn", dots, dx, dw)
    if qtype == "Q4_1":
        y += torch.einsum("tb,nb->tn", sx, mw)
    return y.float()


@pytest.mark.parametrize("qtype", TYPES)
def test_weight_codes_dequantize_like_gguf(qtype: str):
    """The reference's reading of the blocks is gguf's: codes * d (+ m) = gguf.dequantize."""
    blocks = random_blocks(qtype, 9, 96, seed=2)
    codes, d, m = weight_codes(blocks, qtype)
    w = (codes * d[..., None] + (m[..., None] if qtype == "Q4_1" else 0)).reshape(9, 96)
    torch.testing.assert_close(w, reference_dequantize(blocks, qtype), rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_quantize_equals_torch_exactly(isa: str):
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(3)) * torch.tensor([1e-3, 1, 30, 1, 1e4])[:, None]
    x[2, 32:64] = 0  # a zero block: d = 0, codes 0
    x[3, :32] = torch.arange(32) - 15.5  # halves that round to even
    q, d, s = qk.quantize_q8(x, isa)
    want_q, want_d, want_s = reference_quantize(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    torch.testing.assert_close(q.float(), want_q.reshape(5, 160), rtol=0, atol=0)
    torch.testing.assert_close(d, want_d, rtol=0, atol=0)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)


# N from 1 to 300 (not multiples of the kernel's 4-row tiles or 16-row groups), K multiples of the
# 32-block only, rows of x from 1 to 17 (every remainder of the kernel's 4-row tiles)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 1, 32), (1, 33, 96), (2, 50, 608), (3, 17, 160), (4, 7, 96), (5, 300, 224),
                                      (7, 70, 96), (16, 45, 608), (17, 19, 32)])
def test_matmul_q8_equals_the_same_quantized_math(qtype: str, isa: str, rows: int, n: int, k: int):
    blocks = random_blocks(qtype, n, k, seed=rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = qk.matmul_q8(x, blocks, qtype, isa)
    assert got.shape == (rows, n)
    want = reference_matmul_q8(x, blocks, qtype)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_q8_is_close_to_fp32_linear(qtype: str, isa: str):
    """The activations' rounding (at most d/2 per value, d = max|x|/127 per block) moves y by
    well under 2% of its size on random data."""
    blocks = random_blocks(qtype, 64, 576, seed=4)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(4))
    want = F.linear(x, reference_dequantize(blocks, qtype))
    got = qk.matmul_q8(x, blocks, qtype, isa)
    assert float((got - want).norm() / want.norm()) < 0.02


def test_matmul_q8_accepts_a_strided_row_view():
    blocks = random_blocks("Q4_1", 20, 64, seed=5)
    x = torch.randn(9, 64)
    torch.testing.assert_close(qk.matmul_q8(x[::2], blocks, "Q4_1"), reference_matmul_q8(x[::2], blocks, "Q4_1"),
                               rtol=1e-5, atol=1e-5)


def test_matmul_q8_refuses_bad_inputs():
    blocks = random_blocks("Q8_0", 4, 64, seed=6)
    with pytest.raises(RuntimeError, match="hold K"):
        qk.matmul_q8(torch.randn(2, 64), blocks[:, :-1].contiguous(), "Q8_0")
    with pytest.raises(RuntimeError, match="x must be float32"):
        qk.matmul_q8(torch.randn(2, 32), blocks, "Q8_0")


def test_quant_linear_runs_int8_up_to_max_rows_and_dense_above():
    blocks = random_blocks("Q4_1", 40, 96, seed=7)
    w = reference_dequantize(blocks, "Q4_1")
    bias = torch.randn(40)
    layer = QuantLinear([QuantWeight(blocks, "Q4_1", "blk.0.ffn_up.weight")], bias, Linear(w, bias, "torch"),
                        max_rows=4, int8_activations=True)
    assert layer.kind == "gguf-q8"
    assert layer.scales is None  # the fp32 scale pairs serve only the fp32 kernel: not kept for int8
    x = torch.randn(5, 96)
    torch.testing.assert_close(layer(x[:4]), reference_matmul_q8(x[:4], blocks, "Q4_1") + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)  # 5 rows > max_rows: fp32
