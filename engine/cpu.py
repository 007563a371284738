"""What the host CPU can do: its model name and the x86 features our kernels choose by.

Read once from /proc/cpuinfo (Linux); elsewhere the flags are empty and every kernel takes its
portable path. Benchmarks record `cpu_info().as_dict()` so a figure names the machine it came from.
"""

from __future__ import annotations

import functools
import platform

import msgspec

# the features that change which kernel is fastest or correct here
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


class CpuInfo(msgspec.Struct, frozen=True):
    model: str
    features: tuple[str, ...]  # the subset of FEATURES this CPU has
    num_logical_cores: int

    def has(self, feature: str) -> bool:
        return feature in self.features

    @property
    def has_vnni(self) -> bool:
        """int8 dot products accumulate in int32 (AVX512-VNNI or AVX-VNNI)."""
        return self.has("avx512_vnni") or self.has("avx_vnni")

    def as_dict(self) -> dict:
        return {"model": self.model, "features": list(self.features), "num_logical_cores": self.num_logical_cores}

    def describe(self) -> str:
        return f"{self.model} ({', '.join(self.features) or 'no x86 SIMD features'}; {self.num_logical_cores} cores)"


def parse_cpuinfo(text: str) -> CpuInfo:
    model, flags, cores = "", set(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return CpuInfo(model or platform.processor() or platform.machine(), tuple(f for f in FEATURES if f in flags), cores)


@functools.cache
def cpu_info() -> CpuInfo:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        import os
        return CpuInfo(platform.processor() or platform.machine(), (), os.cpu_count() or 1)
