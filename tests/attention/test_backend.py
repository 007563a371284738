"""get_backend: a backend that cannot run on the engine's device is refused by name at start,
not left to fail inside its first kernel launch (Triton's "0 active drivers")."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import get_backend


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
