"""What the host CPU can do: its model name and the x86 features our kernels choose by.

Read once from /proc/cpuinfo (Linux); elsewhere the flags are empty and every kernel takes its
portable path. Benchmarks record `cpu_info().as_dict()` so a figure names the machine it came from.

STEPWISE_CPU_FEATURES="avx2,fma" (any subset of this CPU's FEATURES, comma-separated; "" = none)
makes our kernels behave as on a CPU with only those features: their paths, row thresholds and
compiler flags follow it, and benchmarks record the restriction. It is for measuring what an
older CPU would see on a newer one (torch's own kernels take ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA for the same); naming a feature this CPU lacks is an error.
"""

from __future__ import annotations

import functools
import os
import platform

import msgspec

# the features that change which kernel is fastest or correct here
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


RESTRICT_ENV = "STEPWISE_CPU_FEATURES"


class CpuInfo(msgspec.Struct, frozen=True):
    model: str
    features: tuple[str, ...]  # the subset of FEATURES this CPU has (or that RESTRICT_ENV leaves)
    num_logical_cores: int
    restricted_from: tuple[str, ...] | None = None  # the CPU's own features, where RESTRICT_ENV narrowed them

    def has(self, feature: str) -> bool:
        return feature in self.features

    @property
    def has_vnni(self) -> bool:
        """int8 dot products accumulate in int32 (AVX512-VNNI or AVX-VNNI)."""
        return self.has("avx512_vnni") or self.has("avx_vnni")

    def as_dict(self) -> dict:
        out = {"model": self.model, "features": list(self.features), "num_logical_cores": self.num_logical_cores}
        if self.restricted_from is not None:
            out["restricted_from"] = list(self.restricted_from)
        return out

    def describe(self) -> str:
        restricted = "" if self.restricted_from is None else f", restricted by {RESTRICT_ENV} from {', '.join(self.restricted_from)}"
        return (f"{self.model} ({', '.join(self.features) or 'no x86 SIMD features'}; {self.num_logical_cores} cores"
                f"{restricted})")

    def compiler_flags(self) -> list[str]:
        """Flags for a kernel built for this CPU: -march=native, or, when restricted, just the
        instruction sets left (so the build cannot use what the restriction removed)."""
        if self.restricted_from is None:
            return ["-march=native"]
        flags = {"avx2": ["-mavx2", "-mf16c"], "fma": ["-mfma"], "avx512f": ["-mavx512f"], "avx512bw": ["-mavx512bw"],
                 "avx512_vnni": ["-mavx512vnni"], "avx_vnni": ["-mavxvnni"], "avx512_bf16": ["-mavx512bf16"],
                 "amx_tile": ["-mamx-tile"]}
        return [f for feature in self.features for f in flags[feature]]

    def restricted(self, spec: str) -> CpuInfo:
        """This CPU as if it had only the features named in `spec` (comma-separated)."""
        wanted = [f.strip() for f in spec.split(",") if f.strip()]
        unknown = [f for f in wanted if f not in FEATURES]
        if unknown:
            raise ValueError(f"{RESTRICT_ENV}: unknown feature(s) {unknown}; choose from {FEATURES}")
        missing = [f for f in wanted if not self.has(f)]
        if missing:
            raise ValueError(f"{RESTRICT_ENV}: this CPU ({self.describe()}) lacks {missing}")
        return CpuInfo(self.model, tuple(f for f in self.features if f in wanted), self.num_logical_cores,
                       restricted_from=self.features)


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
            info = parse_cpuinfo(f.read())
    except OSError:
        info = CpuInfo(platform.processor() or platform.machine(), (), os.cpu_count() or 1)
    spec = os.environ.get(RESTRICT_ENV)
    return info if spec is None else info.restricted(spec)


# The GGUF block kernel's code paths (engine/model/quant_kernel.py), the features each needs,
# best first; and by path, the most rows a step runs on the kernel before the dense fp32 copy
# takes over (engine/model/quant_linear.py). Crossovers with oneDNN's fp32 GEMM, whole decode
# steps through the C++ layer loop: on an AVX-512 CPU (Zen 4) at 6-8 rows, where oneDNN gains
# more from the wider vectors than the kernel does (session 11: 12 rows 36 ms dense against
# 45 ms on the kernel). On AVX2 (the stand-in) at ~16 rows while the kernel took dot products
# per pair of rows; since its outer-product panels (session 13) it is 3-17 % faster than the
# dense copies at 16-64 rows (contexts of 200) and even with them at ~128 (projections alone),
# so 64: every decode step of a 64-sequence batch. The int8 kernel ("gguf-q8") has no panels
# and loses above 16 rows (24 rows: 1.09x the dense time), so it stops there, or at the
# path's own limit where that is lower (8 on an AVX-512 CPU, whose dense GEMM wins earlier).
# Here, not in the kernel's module, so the simulator (no torch) splits its step-cost fits where
# the engine switches.
KERNEL_ISA_FEATURES = {"avx512": ("avx512f", "avx512bw"), "avx2": ("avx2", "fma"), "portable": ()}
NATIVE_MAX_ROWS = {"avx512": 8, "avx2": 64, "portable": 16}
Q8_MAX_ROWS = 16


def kernel_max_rows(isa: str, int8_activations: bool = False) -> int:
    """The most rows a step runs on the block kernel of path `isa` (on int8 activations: gguf-q8)."""
    return min(NATIVE_MAX_ROWS[isa], Q8_MAX_ROWS) if int8_activations else NATIVE_MAX_ROWS[isa]


def kernel_isa_supported(isa: str) -> bool:
    """Whether this CPU (or its STEPWISE_CPU_FEATURES restriction) has what the kernel's `isa` path needs."""
    return all(cpu_info().has(f) for f in KERNEL_ISA_FEATURES[isa])


def kernel_isa() -> str:
    """The best kernel path this CPU runs."""
    return next(isa for isa in KERNEL_ISA_FEATURES if kernel_isa_supported(isa))
