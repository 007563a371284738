"""Build our C++ CPU kernels at first use, and load each once per process.

A kernel is compiled with torch.utils.cpp_extension into the torch extensions directory
($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), where later processes find it (a build
takes ~10-30 s; ninja comes from PATH or the `ninja` wheel). OpenMP is on, so at::parallel_for
follows torch.get_num_threads(). A failed build raises RuntimeError naming the compiler's
complaint; `KernelLoader` remembers it so callers can ask first and fall back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.cpu import cpu_info

_STALE_LOCK_S = 600  # a build takes well under a minute


def _wait_for_lock(lock: Path, poll_s: float = 0.5) -> None:
    """Wait out another process's build of the same kernel; a lock older than _STALE_LOCK_S is
    a killed build's, dropped. (torch waits for ever on a lock file, and a lock that was merely
    young when first seen would otherwise never be judged stale: a killed build's lock hung the
    next start, or test run, for good.)"""
    while lock.exists():
        try:
            if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
                lock.unlink(missing_ok=True)
                return
        except FileNotFoundError:  # the build finished meanwhile
            return
        time.sleep(poll_s)


def cpu_tag() -> str:
    """Short hash of this CPU's model and ISA flags: a -march=native build is only reused on
    the same kind of CPU (a shared extensions directory would otherwise hand out SIGILLs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        key = "".join(next((ln for ln in lines if ln.startswith(f)), "") for f in ("model name", "flags"))
    except OSError:
        import platform

        key = platform.machine() + platform.processor()
    key += ",".join(cpu_info().features)  # a CPU restricted by STEPWISE_CPU_FEATURES is another build
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def build_extension(name: str, sources: list[Path], variants: list[tuple[str, list[str]]], what: str) -> None:
    """Compile and load `sources` as an op library (no Python module), trying each
    (tag, compiler flags) variant in turn; the first that builds wins."""
    from torch.utils import cpp_extension

    for source in sources:
        if not source.is_file():
            raise RuntimeError(f"kernel source {source} is missing (not packaged?)")
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
    # The sources' hash in the name: checkouts with different kernels never rebuild each other's.
    digest = hashlib.sha1(b"".join(s.read_bytes() for s in sources)).hexdigest()[:8]
    for tag, flags in variants:
        full = f"{name}_{tag}_{digest}"
        _wait_for_lock(Path(cpp_extension._get_build_directory(full, verbose=False)) / "lock")
        try:
            cpp_extension.load(
                name=full,
                sources=[str(s) for s in sources],
                extra_cflags=[*flags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            return
        except Exception as e:  # noqa: BLE001 - reported below with the compiler's output
            errors.append(f"[{' '.join(flags)}] {type(e).__name__}: {str(e)[-2000:]}")
    raise RuntimeError(f"could not build the {what}:\n" + "\n".join(errors))


class KernelLoader:
    """Runs `build` once per process (thread-safe), then hands out `op()`; remembers a failure."""

    def __init__(self, build: Callable[[], None], op: Callable[[], object], what: str) -> None:
        self._build, self._op_of, self._what = build, op, what
        self._lock = threading.Lock()
        self._op = None
        self._error: str | None = None

    def get(self):
        with self._lock:
            if self._op is None and self._error is None:
                try:
                    self._build()
                    self._op = self._op_of()
                except Exception as e:  # noqa: BLE001
                    self._error = str(e)
            if self._error is not None:
                raise RuntimeError(f"{self._what} unavailable: {self._error}")
            return self._op

    def available(self) -> bool:
        """Whether the kernel builds and loads here (builds it on the first call)."""
        try:
            self.get()
            return True
        except RuntimeError:
            return False
