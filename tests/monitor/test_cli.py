"""engine-monitor's command line: which source it builds, and clear errors."""

from __future__ import annotations

import pytest

from monitor.cli import DEFAULT_URL, build_parser, main, make_source
from monitor.demo import EngineSource
from monitor.http_source import HttpSource


def test_default_is_the_local_server():
    source = make_source(build_parser().parse_args([]))
    assert isinstance(source, HttpSource) and source.url == DEFAULT_URL


def test_url_and_api_key():
    source = make_source(build_parser().parse_args(["--url", "http://h:9/", "--api-key", "k"]))
    assert source.url == "http://h:9" and source._headers == {"Authorization": "Bearer k"}


def test_demo_builds_an_embedded_engine_with_overrides(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[scheduler]\nmax_num_batched_tokens = 96\n")
    args = build_parser().parse_args(["--demo", "--config", str(cfg), "--policy", "continuous", "--long-tokens", "700"])
    source = make_source(args)
    assert isinstance(source, EngineSource)
    assert source.config.scheduler.policy == "continuous" and source.config.scheduler.max_num_batched_tokens == 96
    assert source.config.model.model == "smollm2-135m"
    assert source.load_settings.long_prompt_tokens == 700 and source.engine is None  # nothing started yet


def test_replica_of_a_cluster():
    source = make_source(build_parser().parse_args(["--url", "http://h:9", "--replica", "replica-1"]))
    assert source.replica == "replica-1" and source._query == {"replica": "replica-1"}
    assert source.description == "http://h:9 · replica-1"


@pytest.mark.parametrize("argv", [["--policy", "static"], ["--url", "http://x", "--demo"],
                                  ["--demo", "--policy", "fifo"], ["--demo", "--replica", "replica-0"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "engine-monitor" in capsys.readouterr().err


def test_bad_config_is_a_message_not_a_traceback(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[scheduler]\nchunk_sizes = 3\n")
    assert main(["--demo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine-monitor: ") and "chunk_sizes" in err and "Traceback" not in err


@pytest.mark.parametrize(("url", "says"), [
    ("localhost:8000", "expected http://HOST:PORT"), ("ftp://h:21", "expected http://HOST:PORT"),
    ("not a url", "expected http://HOST:PORT"), ("http://h:99999", "Port out of range"),
    ("http://h:eighty", "Port could not be cast"), ("http:///v1", "expected http://HOST:PORT"),
    ("http://h:0", "port 0 is no server's port"), ("http://h:8000?x=1", "expected http://HOST:PORT"),
])
def test_an_unusable_url_is_refused_before_the_dashboard_starts(url, says, capsys):
    """These used to be retried for ever as connection errors."""
    assert main(["--url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"engine-monitor: --url {url!r}: ") and says in err


async def test_a_demo_engine_that_cannot_start_is_refused_not_retried():
    from engine.config import EngineConfig
    from monitor.source import Backoff, Refused, follow

    source = EngineSource(EngineConfig.load(None, model="/nowhere/model.gguf"), load=None)
    events = [ev async for ev in follow(source, backoff=Backoff(0.01))]  # ends by itself
    await source.close()
    assert isinstance(events[-1], Refused) and events[-1].reason.startswith("the engine failed to start: ")
    assert "/nowhere/model.gguf" in events[-1].reason
