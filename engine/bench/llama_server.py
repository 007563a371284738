"""The llama.cpp peer: a `llama-server` process on the same GGUF file, run in remote mode.

engine-bench starts the binary given by --llama-server (build one with
examples/build_llama_server.sh) on a free loopback port with `-t` = our thread count, one
parallel slot per request that can be in flight at once, and a context of that many slots of
the workload's longest request; then it sends the workload through the same OpenAI-compatible
client as for any server (runner.run_remote: streaming /v1/completions, token-id prompts,
temperature 0, ignore_eos) and stops the process. Its log goes to `<out>/llama-server.log`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.bench.workload import BenchRequest

NAME = "llama.cpp"
START_TIMEOUT_S = 120.0  # loading a small GGUF takes a second or two; a big one longer
STOP_TIMEOUT_S = 10.0
_CTX_MARGIN = 16  # tokens of slack per slot


def settings(threads: int, requests: list[BenchRequest], max_parallel: int) -> dict[str, int]:
    """One slot per request in flight (at most max_parallel), each slot holding the workload's
    longest prompt + output (results.json records these)."""
    slots = max(1, min(len(requests), max_parallel))
    per_slot = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + _CTX_MARGIN
    return {"threads": threads, "parallel": slots, "ctx_size": slots * per_slot}


def server_args(binary: str, gguf: Path, port: int, threads: int, requests: list[BenchRequest], max_parallel: int) -> list[str]:
    s = settings(threads, requests, max_parallel)
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(s["parallel"]), "-c", str(s["ctx_size"]), "--no-warmup"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def resolve_binary(path: str | None) -> str:
    if not path:
        raise ValueError("--peer llama.cpp needs --llama-server PATH (build one with examples/build_llama_server.sh)")
    found = shutil.which(path) or (path if Path(path).is_file() else None)
    if found is None:
        raise ValueError(f"--llama-server {path!r}: no such executable")
    return found


@contextmanager
def llama_server(binary: str, gguf: Path, threads: int, requests: list[BenchRequest], max_parallel: int,
                 log: Path) -> Iterator[str]:
    """Run llama-server for the block; yields its base URL once /health answers 200."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_args(binary, gguf, port, threads, requests, max_parallel),
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with code {proc.returncode}; see {log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not healthy after {START_TIMEOUT_S:.0f} s; see {log}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
