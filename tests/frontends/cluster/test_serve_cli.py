"""`engine-serve --replicas 2` as a real process (tiny model, its own local Ray): it serves,
and SIGTERM drains as `engine-serve` does — new requests 503 at once, a short stream
finishes, a long one is aborted after the grace period with an error event and [DONE] —
then the replicas and Ray go down and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

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
