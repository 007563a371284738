"""Engine start-up refuses a device it cannot run on, naming it."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from tests.engine.util import tiny_config


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
async def test_cuda_without_a_cuda_device_is_refused_by_name():
    with pytest.raises(ValueError, match="device 'cuda': this torch .* sees no CUDA device"):
        await Engine(tiny_config(device="cuda")).start()
