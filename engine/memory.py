"""Memory free for a new allocation. Start-up checks a model's weights and the KV pool against
it, so that too large a model or pool is an error naming it rather than the OOM killer's SIGKILL
(no message) or a machine swapping."""

from __future__ import annotations

import torch


def available_bytes(device: torch.device) -> int | None:
    """The kernel's MemAvailable on CPU (None where /proc/meminfo is missing), the CUDA
    allocator's free memory on a GPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
