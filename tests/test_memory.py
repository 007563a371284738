"""engine.memory: the free memory start-up checks against."""

from __future__ import annotations

import os

import torch

from engine import memory


def test_available_bytes_reads_this_machine():
    free = memory.available_bytes(torch.device("cpu"))
    assert (free > 0) if os.path.exists("/proc/meminfo") else free is None
