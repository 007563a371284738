"""engine-bench's flags: what cannot mean anything is refused, naming the flag, before a model
loads or a request is sent (the tiny random model where a run is needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine.bench import cli

TINY = ["--model", "tiny-random", "--set", "num_blocks=256", "--no-plots"]


@pytest.mark.parametrize(("argv", "why"), [
    (["--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
    (["--num-requests", "-1"], "argument --num-requests: must be >= 1, got -1"),
    (["--rate", "-5"], "argument --rate: must be >= 0, got -5"),
    (["--rate", "inf"], "argument --rate: must be a finite number, got inf"),
    (["--rate", "nan"], "argument --rate: must be a finite number, got nan"),
    (["--vocab-size", "0"], "argument --vocab-size: must be >= 2, got 0"),
])
def test_meaningless_flag_values_are_argparse_errors(argv, why, tmp_path, capsys):
    """The same argparse types as engine-sim's (engine/cli_args.py): exit 2, naming the flag."""
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert f"engine-bench: error: {why}" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--workload", "spike", "--rate", "2"], "--rate: the spike workload times its own arrivals"),
    (["--policies", "chunked,chunked"], "--policies: chunked given more than once"),
    (["--policies", "fifo"], "--policies: config key 'policy'"),
    (["--sweep", "model=tiny-random,smollm2-135m"], "--sweep model: the model is loaded once for every run"),
    (["--sweep", "dtype=float32,bfloat16"], "--sweep dtype: the model is loaded once"),
    (["--sweep", "max_num_seqs=4,0"], "--sweep max_num_seqs=0: config key 'max_num_seqs' must be >= 1"),
    (["--set", "max_num_seqs=0"], "config key 'max_num_seqs' must be >= 1"),
    (["--config", "/nowhere/stepwise.toml"], "--config /nowhere/stepwise.toml: No such file or directory"),
    (["--url", "http://127.0.0.1:9", "--set", "max_num_seqs=4"], "--set: the server at --url runs its own config"),
    (["--url", "http://127.0.0.1:9", "--policies", "chunked", "--config", "c.toml"],
     "--config, --policies: the server at --url runs its own config"),
])
def test_meaningless_flags_are_refused_up_front(argv, says, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "load_model", _no_load)
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--out", str(tmp_path)])
    assert says in str(e.value)


def _no_load(*_args, **_kw):
    raise AssertionError("the model was loaded before the flags were checked")


async def _refusing_models(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "invalid or missing API key"}}, status=401)


def test_a_server_that_refuses_the_run_is_a_message_not_a_traceback(tmp_path):
    import asyncio

    async def serve_and_bench():
        app = web.Application()
        app.router.add_get("/v1/models", _refusing_models)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            return await asyncio.to_thread(_bench_exit, f"http://127.0.0.1:{server.port}", tmp_path)
        finally:
            await server.close()

    message = asyncio.run(serve_and_bench())
    assert message.startswith("--url http://127.0.0.1:") and "HTTP 401" in message and "API key" in message
    unreachable = _bench_exit("http://127.0.0.1:9", tmp_path)
    assert unreachable.startswith("--url http://127.0.0.1:9: ") and "Cannot connect" in unreachable


def _bench_exit(url: str, out: Path) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(["--url", url, "--workload", "single", "--no-plots", "--out", str(out)])
    return str(e.value)


def test_a_run_whose_every_request_failed_exits_non_zero(tmp_path):
    """Token ids beyond the tiny model's vocabulary: every request is refused, the table is
    zeros, and the command says so instead of exiting 0."""
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, "--policies", "chunked", "--workload", "single", "--vocab-size", "100000",
                  "--out", str(tmp_path)])
    assert "every request of chunked failed" in str(e.value)
    assert json.loads((tmp_path / "results.json").read_text())["results"]["chunked"]["num_failed"] == 1
