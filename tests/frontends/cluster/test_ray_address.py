"""`engine-serve --replicas 1 --ray-address ADDR` joins a Ray cluster that is already running
(a head started with `ray start --head`, as on a real cluster) instead of starting a local one:
it serves, and on SIGTERM takes down only its own Serve applications — the cluster stays up.
`ray start --head` turns on Ray's token authentication; a client joining by address then needs
RAY_AUTH_MODE=token (the token is in ~/.ray/auth_token on this machine), as the README says."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")

from tests.reliability.util import COMPLETIONS, REPO  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
CLIENT_ENV = {**os.environ, "RAY_AUTH_MODE": "token"}  # joining a token-auth cluster by address


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ray_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(RAY, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, env=CLIENT_ENV)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


async def test_joins_a_running_cluster_and_leaves_it_running():
    address = f"127.0.0.1:{free_port()}"
    head = await asyncio.create_subprocess_exec(
        RAY, "start", "--head", "--block", f"--port={address.split(':')[1]}", "--num-cpus=2",
        "--include-dashboard=false", "--disable-usage-stats",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    serve = None
    try:
        async with asyncio.timeout(120):
            while (await ray_cli("status", f"--address={address}"))[0] != 0:
                assert head.returncode is None, "ray start --head exited"
                await asyncio.sleep(1)
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "frontends.cli", "--model", "tiny-random", "--port", "0", "--served-model-name",
            "tiny", "--num-blocks", "512", "--replicas", "1", "--replica-cpus", "1", "--ray-address", address,
            "--attention-backend", "torch", stderr=asyncio.subprocess.PIPE, cwd=REPO, env=CLIENT_ENV)
        banner = []
        async with asyncio.timeout(300):
            while "listening on " not in (line := (await serve.stderr.readline()).decode()):
                assert line, "engine-serve --ray-address exited early: " + "".join(banner)[-2000:]
                banner.append(line)
        assert any(f"replica(s) on {address}" in b for b in banner), banner
        url = line.split("listening on ")[1].split()[0]
        log = asyncio.create_task(serve.stderr.read())
        async with asyncio.timeout(120), aiohttp.ClientSession(url) as http:
            assert (await http.get("/health")).status == 200
            async with http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, "temperature": 0}) as resp:
                assert resp.status == 200 and resp.headers["x-stepwise-replica"] == "replica-0"
                assert (await resp.json())["usage"]["completion_tokens"] == 4
        serve.send_signal(signal.SIGTERM)
        async with asyncio.timeout(120):
            assert await serve.wait() == 0, (await log).decode()[-2000:]
        code, status = await ray_cli("status", f"--address={address}")
        assert code == 0, f"the cluster went down with engine-serve: {status[-1000:]}"
    finally:
        for proc in (serve, head):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node on SIGTERM
                try:
                    async with asyncio.timeout(60):
                        await proc.wait()
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
