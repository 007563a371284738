"""Shared by the simulator's tests: a known fake machine and small configs."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.sim.calibration import Calibration

# 5 ms + 0.4 ms a prompt token + 1 ms a decode + 0.1 ms a sequence + 20 ns an attention pair
# + 100 ns a cached K/V position read;
# 2 ms + 0.05 ms a sequence of overhead
CAL = Calibration(
    forward={"fixed": 0.005, "prefill_token": 4e-4, "decode_token": 1e-3, "sequence": 1e-4, "attention_pair": 2e-8,
             "kv_token": 1e-7},
    overhead={"fixed": 0.002, "sequence": 5e-5}, num_steps=0, model="fake", dtype="float32",
)


def config(**overrides) -> EngineConfig:
    base = {"model": "tiny-random", "num_blocks": 512, "block_size": 16, "max_num_seqs": 16, "max_waiting": 4096}
    base.update(overrides)
    return EngineConfig().with_overrides(**base)
