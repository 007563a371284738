"""Session-scoped model fixtures shared by the model tests.

The real model (SmolLM2-135M-Instruct) is loaded once per session through the same cache
directory the engine uses (config.toml's [model] cache_dir, default $XDG_CACHE_HOME/stepwise),
so CI, users and tests share one converted copy. The first run converts the GGUF (~20 s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton kernels run under its interpreter on machines without a GPU. This must be set before
# anything imports triton (transformers does, indirectly), hence here, first.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # tests import `tests.paged` and `engine.*`
    sys.path.insert(0, str(REPO_ROOT))

from engine.attention.torch_backend import TorchAttention  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.loader import LoadedModel, load_model  # noqa: E402


def _cache_dir() -> Path:
    return EngineConfig.load(REPO_ROOT / "config.toml").model.resolved_cache_dir()


@pytest.fixture(scope="session")
def real_model() -> LoadedModel:
    return load_model("smollm2-135m", _cache_dir())


@pytest.fixture(scope="session")
def ours(real_model: LoadedModel) -> LlamaModel:
    # weight_format "auto": the GGUF blocks run natively where the kernel builds (the default path)
    return LlamaModel(real_model.hf_model, TorchAttention(), gguf=real_model.gguf)


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return load_model("tiny-random", _cache_dir())


@pytest.fixture(scope="session")
def tiny_ours(tiny_model: LoadedModel) -> LlamaModel:
    return LlamaModel(tiny_model.hf_model, TorchAttention())
