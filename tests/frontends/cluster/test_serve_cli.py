"""`engine-serve --replicas 2` as a real process (tiny model, its own local Ray): it serves,
and SIGTERM drains as `engine-serve` does — new requests 503 at once, a short stream
finishes, a long one is aborted after the grace period with an error event and [DONE] —
then the replicas and Ray go down and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")

from tests.reliability.util import COMPLETIONS, REPO, is_openai_error  # noqa: E402


async def read_stream(resp: aiohttp.ClientResponse, first: bytes) -> list:
    frames = (first + await resp.read())[:-2].split(b"\n\n")
    return [f[6:].decode() if f == b"data: [DONE]" else json.loads(f[6:]) for f in frames]


async def test_replicas_serve_and_sigterm_drains_then_exits_0():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "frontends.cli", "--model", "tiny-random", "--port", "0", "--served-model-name", "tiny",
        "--num-blocks", "1024", "--replicas", "2", "--replica-cpus", "0.5", "--ray-num-cpus", "2",
        "--shutdown-grace-ms", "1500", "--attention-backend", "torch", stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    try:
        async with asyncio.timeout(300):
            while "listening on " not in (line := (await proc.stderr.readline()).decode()):
                assert line, "engine-serve --replicas exited early"
        url = line.split("listening on ")[1].split()[0]
        log = asyncio.create_task(proc.stderr.read())
        async with asyncio.timeout(240), aiohttp.ClientSession(url) as http:
            assert (await http.get("/health")).status == 200
            streams = []
            for max_tokens in (8, 1900):
                resp = await http.post(COMPLETIONS, json={"prompt": f"run {max_tokens}", "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True, "stream": True})
                assert resp.status == 200 and resp.headers["x-stepwise-replica"].startswith("replica-")
                streams.append((resp, await resp.content.readuntil(b"\n\n")))

            proc.send_signal(signal.SIGTERM)
            while True:  # until the signal is handled a request may still be taken
                async with http.post(COMPLETIONS, json={"prompt": "late", "max_tokens": 2}) as resp:
                    if resp.status == 503:
                        refused = await resp.json()
                        break
                    assert resp.status == 200
            assert is_openai_error(refused) and refused["error"]["code"] == "shutting_down"

            short, long_ = [await read_stream(resp, first) for resp, first in streams]
            assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
            assert long_[-1] == "[DONE]" and long_[-2]["error"]["code"] == "shutting_down"
        async with asyncio.timeout(120):
            assert await proc.wait() == 0, (await log).decode()[-2000:]
        assert "[stepwise] stopped" in (await log).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def ray_processes_marked(marker: str) -> list[str]:
    """Processes whose environment holds `marker` (those of the Ray the test's server started)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads other processes' environments from /proc")
async def test_sigterm_during_start_up_stops_the_local_ray_at_once():
    """It waited for the replicas to load (~2 minutes on a loaded machine) before stopping; a
    second signal then exited at once but left Ray's agents running."""
    marker = f"stepwise-test-{uuid.uuid4().hex}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "frontends.cli", "--model", "tiny-random", "--port", "0", "--replicas", "1",
        "--replica-cpus", "0.5", "--ray-num-cpus", "1", "--attention-backend", "torch",
        stderr=asyncio.subprocess.PIPE, cwd=REPO, env={**os.environ, "STEPWISE_TEST_MARKER": marker},
    )
    try:
        async with asyncio.timeout(180):
            while "starting 1 engine replica" not in (line := (await proc.stderr.readline()).decode()):
                assert line, "engine-serve --replicas exited early"
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            log = (await proc.stderr.read()).decode()
            assert await proc.wait() == 0, log[-2000:]
        assert "stopping the local Ray" in log and "[stepwise] stopped" in log
        for _ in range(50):  # Ray's processes go with its shutdown; give the last ones a moment
            if not ray_processes_marked(marker):
                break
            await asyncio.sleep(0.2)
        assert not ray_processes_marked(marker)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
