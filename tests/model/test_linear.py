"""Dense projections: the oneDNN prepacked path equals F.linear, and bad choices fail clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu import cpu_info
from engine.model.linear import Linear, int8_reduce_range, resolve
from engine.model.llama import LlamaModel
from engine.attention.torch_backend import TorchAttention
from tests.paged import PagedRunner

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_equals_f_linear(rows: int, with_bias: bool):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)  # [N, K]
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    got = Linear(weight, bias, "onednn")(x)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reduce_range", [None, True, False], ids=["for-this-cpu", "7-bit", "8-bit"])
def test_int8_is_close_to_f_linear(with_bias: bool, reduce_range: bool | None):
    if reduce_range is False and not cpu_info().has_vnni:
        pytest.skip("8-bit activations need VNNI (int32 dot products); without it torch's int16 pair sums saturate")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(33, 40, generator=g)
    want = F.linear(x, weight, bias)
    got = Linear(weight, bias, "int8", reduce_range)(x)
    # int8 weights and per-step int8 activations: about 1 % of the output's scale, not exact
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert not torch.equal(got, want)


def test_int8_reduce_range_follows_the_cpu():
    assert int8_reduce_range() is (not cpu_info().has_vnni)


@onednn
def test_onednn_accepts_a_strided_row_view():
    weight, x = torch.randn(32, 16), torch.randn(10, 16)
    torch.testing.assert_close(Linear(weight, None, "onednn")(x[::2]), F.linear(x[::2], weight))


def test_resolve():
    cpu = torch.device("cpu")
    assert resolve("torch", cpu, torch.float32) == "torch"
    assert resolve("auto", cpu, torch.bfloat16) == "torch"
    assert resolve("auto", torch.device("cuda"), torch.float32) == "torch"
    if torch.backends.mkldnn.is_available():
        assert resolve("auto", cpu, torch.float32) == "onednn"
    assert resolve("int8", cpu, torch.float32) == "int8"  # opt-in only, never "auto"
    with pytest.raises(ValueError, match="onednn"):
        resolve("onednn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="int8"):
        resolve("int8", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown linear backend"):
        resolve("blas", cpu, torch.float32)


@onednn
def test_tiny_model_greedy_is_the_same_on_both_linear_backends(tiny_model):
    prompt = list(range(3, 40))
    runs = {
        kind: PagedRunner(LlamaModel(tiny_model.hf_model, TorchAttention(), linear=kind), num_blocks=16).greedy(0, prompt, 16)
        for kind in ("onednn", "torch")
    }
    assert runs["onednn"] == runs["torch"]
