"""engine-serve: flags generated 1:1 from the config keys, and a real process that serves,
then shuts down cleanly on SIGINT (live stream ended properly, exit code 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys

import aiohttp
import pytest

from engine import EngineConfig
from engine.config import all_keys
from frontends.cli import build_parser, load_config


def test_every_config_key_has_a_flag():
    help_text = build_parser().format_help()
    for key in all_keys():
        assert "--" + key.replace("_", "-") in help_text, key
    assert "--config" in help_text


def test_flags_override_the_config_file(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[scheduler]\npolicy = "continuous"\nchunk_size = 64\n[server]\nport = 9000\n')
    args = build_parser().parse_args([
        "--config", str(toml), "--policy", "static", "--max-num-batched-tokens", "512", "--port", "0",
        "--no-enable-prefix-caching", "--api-key", "k", "--model", "tiny-random",
    ])
    config = load_config(args)
    assert config.scheduler.policy == "static" and config.scheduler.chunk_size == 64
    assert config.scheduler.max_num_batched_tokens == 512 and config.server.port == 0
    assert config.cache.enable_prefix_caching is False and config.server.api_key == "k"
    assert config.model.model == "tiny-random"


def test_bad_flag_values_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--port", "eighty"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        from frontends.cli import main
        main(["--config", "/nonexistent.toml"])
    assert e.value.code == 2


def test_prefix_router_keys_under_another_router_exit_2(capsys):
    """Never read by round-robin or least-loaded: engine-serve accepted them in silence."""
    from frontends.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny-random", "--replicas", "2", "--router", "least-loaded", "--prefix-min-share", "0.3"])
    assert e.value.code == 2
    assert "[cluster] prefix_min_share: only the prefix router reads them, and router is 'least-loaded'" in \
        capsys.readouterr().err


async def test_serve_stream_and_sigint():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "frontends.cli", "--model", "tiny-random", "--port", "0", "--served-model-name", "tiny",
        "--shutdown-grace-ms", "0",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        url = None
        while url is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, "engine-serve exited early"
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
        log = asyncio.create_task(proc.stderr.read())
        async with aiohttp.ClientSession(url) as http:
            statuses = []
            while not statuses or statuses[-1] != 200:
                async with http.get("/health") as resp:
                    statuses.append(resp.status)
                await asyncio.sleep(0.05)
            assert set(statuses) <= {200, 503}
            async with http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1500, "ignore_eos": True,
                                                          "stream": True}) as resp:
                first = await resp.content.readuntil(b"\n\n")
                assert json.loads(first[6:])["object"] == "text_completion"
                proc.send_signal(signal.SIGINT)
                rest = await asyncio.wait_for(resp.read(), 15)
            assert rest.endswith(b'"code":"shutting_down"}}\n\ndata: [DONE]\n\n')
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert "stopped" in (await log).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_port_in_use_exits_1_naming_it(capsys):
    """A port in use (or a host that does not resolve) is a line naming it and exit 1, not a traceback."""
    from frontends.cli import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EngineConfig.load(None, model="tiny-random", port=port)
        assert await serve(config) == 1
    assert f"cannot listen on host '127.0.0.1', port {port} ([server] host, port): " in capsys.readouterr().err
