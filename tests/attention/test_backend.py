"""get_backend: a backend that cannot run on the engine's device is refused by name at start,
not left to fail inside its first kernel launch (Triton's "0 active drivers")."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import get_backend
from engine.attention.cpu_backend import cpu_kernel_available


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA.*TRITON_INTERPRET=1"):
        get_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_backend("triton", torch.device("cpu")).name == "triton"


def test_cpu_kernel_on_cuda_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="attention_backend 'cpu' is a CPU kernel; this engine runs on cuda"):
        get_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash", torch.device("cpu"))


@pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel")
def test_cpu_kernel_dtypes(capsys):
    """The kernel takes float32 / bfloat16 activations over a cache of their dtype or a narrower
    one (kv_cache_dtype); `auto` falls back to torch for the rest, `cpu` by name refuses them."""
    cpu = torch.device("cpu")
    for dtype, kv in [(torch.float32, None), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                      (torch.bfloat16, None), (torch.bfloat16, torch.float16)]:
        assert get_backend("auto", cpu, dtype, kv).name == "cpu" == get_backend("cpu", cpu, dtype, kv).name
    assert get_backend("auto", cpu, torch.float16).name == "torch"
    assert "attention_backend auto: torch, since the CPU kernel runs float32 or bfloat16 models" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not dtype float16"):
        get_backend("cpu", cpu, torch.float16)
    with pytest.raises(ValueError, match="cannot read a float32 KV cache \\(kv_cache_dtype\\) under a bfloat16 model"):
        get_backend("cpu", cpu, torch.bfloat16, torch.float32)
