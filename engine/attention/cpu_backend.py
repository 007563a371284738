"""Paged attention in a C++ kernel for CPUs: attends straight from the paged KV cache.

`TorchAttention` copies every cached K/V row into a workspace (padded to the longest context)
before SDPA; on a CPU, where long-context decodes are memory-bound, that copy costs about as
much as the attention itself. `CpuAttention` reads the cache in place through the block table
(csrc/paged_attention.cpp): one work item per (tile of query tokens, kv head), online softmax
in fp32, cached context then the step's fresh keys. Same semantics as backend.py.

The kernel is compiled at first use with torch.utils.cpp_extension (-O3 -march=native, falling
back to -O3; OpenMP via at::parallel_for, so it follows torch.get_num_threads()) into the
torch extensions directory ($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), where later
processes find it (a build takes ~10 s; ninja comes from PATH or the `ninja` wheel). A failed
build raises RuntimeError; `cpu_kernel_available()` lets the engine ask first. float32 and
bfloat16 (fp32 accumulation).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.backend import LayerAttention, store_kv
from engine.attention.metadata import AttentionMetadata

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
_STALE_LOCK_S = 600  # a build takes well under a minute
_TOKENS_PER_TILE = 8  # query tokens of one sequence per work item (x G heads = its rows)


def _cpu_tag() -> str:
    """Short hash of this CPU's model and ISA flags: a -march=native build is only reused on
    the same kind of CPU (a shared extensions directory would otherwise hand out SIGILLs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        key = "".join(next((ln for ln in lines if ln.startswith(f)), "") for f in ("model name", "flags"))
    except OSError:
        import platform

        key = platform.machine() + platform.processor()
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def _build() -> None:
    """Compile and load the kernel (registers torch.ops.stepwise_cpu.paged_attention)."""
    from torch.utils import cpp_extension

    if not _SOURCE.is_file():
        raise RuntimeError(f"kernel source {_SOURCE} is missing (not packaged?)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX or install g++)")
    if not cpp_extension.is_ninja_available():
        try:  # the `ninja` wheel puts its binary next to the package, not necessarily on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is required to build C++ extensions: pip install ninja")
    errors = []
    # The source's hash in the name: checkouts with different kernels never rebuild each other's.
    src = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:8]
    for tag, flags in ((f"native_{_cpu_tag()}", ["-O3", "-march=native"]), ("generic", ["-O3"])):
        name = f"stepwise_paged_attention_{tag}_{src}"
        # torch waits forever on the lock file of a build that was killed: drop an old one
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        try:
            cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=[*flags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            return
        except Exception as e:  # noqa: BLE001 - reported below with the compiler's output
            errors.append(f"[{' '.join(flags)}] {type(e).__name__}: {str(e)[-2000:]}")
    raise RuntimeError("could not build the CPU attention kernel:\n" + "\n".join(errors))


class _KernelLoader:
    """Builds the kernel once per process (thread-safe); remembers a failure."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._op = None
        self._error: str | None = None

    def get(self):
        with self._lock:
            if self._op is None and self._error is None:
                try:
                    _build()
                    self._op = torch.ops.stepwise_cpu.paged_attention
                except Exception as e:  # noqa: BLE001
                    self._error = str(e)
            if self._error is not None:
                raise RuntimeError(f"CPU attention kernel unavailable: {self._error}")
            return self._op


_KERNEL = _KernelLoader()


def cpu_kernel_available() -> bool:
    """Whether the C++ kernel builds and loads here (builds it on the first call)."""
    try:
        _KERNEL.get()
        return True
    except RuntimeError:
        return False


@dataclass
class CpuPlan:
    valid: torch.Tensor | None  # [T] bool, None = every slot is stored
    tiles: torch.Tensor  # [num_tiles, 5] int32: seq, first token, num tokens, context, first position
    block_tables: torch.Tensor  # [B, W] int32


class CpuAttention:
    name = "cpu"

    def __init__(self, tokens_per_tile: int = _TOKENS_PER_TILE) -> None:
        self._op = _KERNEL.get()  # fail at construction, not in the middle of a step
        self.tokens_per_tile = tokens_per_tile

    def prepare(self, meta: AttentionMetadata) -> CpuPlan:
        has_skip = bool((meta.slot_mapping < 0).any())
        # A tile's tokens share every K/V row load (prefill); a decode is a one-token tile.
        tokens_per_tile, tiles, start = self.tokens_per_tile, [], 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            for j in range(0, q_len, tokens_per_tile):
                n = min(tokens_per_tile, q_len - j)
                tiles.append((i, start + j, n, ctx, ctx + j))
            start += q_len
        tiles.sort(key=lambda t: -t[2] * (t[4] + t[2]))  # most keys x rows first: threads balance
        return CpuPlan(
            valid=(meta.slot_mapping >= 0) if has_skip else None,
            tiles=torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
        )

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: CpuPlan, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.valid)
        layer = layer or LayerAttention.plain(q.shape[2])
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, H, D]
        self._op(q, k, v, k_cache, v_cache, plan.tiles, plan.block_tables, out,
                 layer.scale, layer.window or 0, layer.softcap or 0.0)
        return out
