"""Remote mode against our own server (HttpFrontend around an Engine on the tiny model), and
the engine-bench CLI end to end: remote, in-process with the three plots, and a sweep.

The tests are synchronous: `run_remote` and `cli.main` run under their own asyncio.run,
while the server lives on an event loop in a background thread."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from engine.bench import cli, workload
from engine.bench.runner import run_remote
from engine.bench.stats import percentile
from frontends.http import HttpFrontend

REPO = Path(__file__).resolve().parents[2]
VOCAB = 259  # tiny-random's byte tokenizer

SUMMARY_KEYS = {  # every result has these; the rest depend on mode and workload
    "num_requests", "num_failed", "duration_s", "output_tokens", "output_tokens_per_s", "requests_per_s",
    "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "itl_ms_max", "tpot_ms_p50", "tpot_ms_p99",
    "e2e_ms_p50", "e2e_ms_p99", "goodput_rps",
}
TAGGED_KEYS = {"long_ttft_ms_p50", "long_ttft_ms_max"}  # mixed and spike have "long" requests
RECORD_KEYS = {"config", "peer", "llama_server", "model", "requests"}  # what ran, not figures
STEP_KEYS = {"num_steps", "padding_waste_pct", "preemptions", "prefix_cache_hit_rate", "tokens_processed",
             "step_time_error_p50"}  # in-process (the step-cost model is calibrated at start-up)


class ThreadedServer:
    """Engine + HttpFrontend on port 0, on an event loop in a daemon thread."""

    def __init__(self, loaded, config: EngineConfig):
        self.loaded, self.config = loaded, config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-server", daemon=True)

    def _call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.engine = Engine(self.config, loaded=self.loaded)
        self.frontend = HttpFrontend("127.0.0.1", 0)
        await self.frontend.start(self.engine)
        await self.engine.start()

    async def _stop(self) -> None:
        await self.frontend.stop()
        await self.engine.stop()

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def server(tiny_model):
    config = EngineConfig.load(None, model="tiny-random", served_model_name="tiny", policy="chunked",
                               num_blocks=256, max_num_batched_tokens=64, chunk_size=32)
    with ThreadedServer(tiny_model, config) as s:
        yield s


def check_schema(summary: dict, targets: list[str], extra: set[str], workload_name: str = "mixed") -> None:
    assert summary["workload"] == workload_name and isinstance(summary["seed"], int)
    assert isinstance(summary["num_requests"], int) and isinstance(summary["plots"], list)
    assert list(summary["results"]) == targets
    for r in summary["results"].values():
        figures = {k: v for k, v in r.items() if k not in RECORD_KEYS}
        assert set(figures) == SUMMARY_KEYS | extra
        assert all(v is None or isinstance(v, int | float) for v in figures.values())
        assert r["num_requests"] == summary["num_requests"] and r["num_failed"] == 0
        check_records(r)
        assert r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["itl_ms_p50"] <= r["itl_ms_p99"] <= r["itl_ms_max"]


def check_records(r: dict) -> None:
    """The per-request records reproduce the result's figures."""
    reqs = r["requests"]
    assert len(reqs) == r["num_requests"] and all(q["error"] is None for q in reqs)
    assert sum(q["output_tokens"] for q in reqs) == r["output_tokens"]
    ttfts = [q["token_times_s"][0] for q in reqs]
    gaps = [b - a for q in reqs for a, b in zip(q["token_times_s"], q["token_times_s"][1:])]
    assert r["ttft_ms_p50"] == pytest.approx(percentile(ttfts, 50) * 1000)
    assert r["itl_ms_p99"] == pytest.approx(percentile(gaps, 99) * 1000)
    assert r["e2e_ms_p99"] == pytest.approx(percentile([q["e2e_s"] for q in reqs], 99) * 1000)
    ends = [q["sent_s"] + q["e2e_s"] for q in reqs]
    assert min(q["sent_s"] for q in reqs) == 0 and max(ends) <= r["duration_s"]


def test_run_remote_against_our_server(server):
    reqs = [dataclasses.replace(r, max_tokens=4 + 2 * i)
            for i, r in enumerate(workload.make("mixed", seed=3, num_requests=8, vocab_size=VOCAB))]
    timings, duration = asyncio.run(run_remote(server.frontend.url, None, reqs))
    assert duration > 0 and len(timings) == len(reqs)
    for r, t in zip(reqs, timings):
        assert t.ok, t.error
        assert t.num_prompt_tokens == len(r.prompt_token_ids)
        assert t.num_output_tokens == r.max_tokens  # ignore_eos; counted from the usage chunk
        # one time per content chunk: the byte tokenizer holds back tokens that end mid-character
        assert 1 <= len(t.token_times) <= r.max_tokens
        assert t.ttft is not None and 0 < t.ttft <= t.e2e
        assert t.token_times == sorted(t.token_times) and t.token_times[0] == t.first_token
        assert t.tpot is not None and t.tpot >= 0
    assert sum(len(t.itls) for t in timings) > 0


def test_run_remote_reports_failures(server):
    bad = workload.BenchRequest([VOCAB + 5], 4, 0.0)  # a token id outside the vocabulary: HTTP 400
    good = workload.BenchRequest([120, 121, 122], 3, 0.0)
    timings, _ = asyncio.run(run_remote(server.frontend.url, "tiny", [bad, good]))
    assert not timings[0].ok and "HTTP 400" in timings[0].error
    assert timings[1].ok and timings[1].num_output_tokens == 3


def test_cli_remote(server, tmp_path, capsys):
    cli.main(["--url", server.frontend.url, "--workload", "mixed", "--num-requests", "6", "--vocab-size", str(VOCAB),
              "--slo-ttft-ms", "60000", "--no-plots", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "results.json").read_text())
    check_schema(summary, [server.frontend.url], TAGGED_KEYS)
    assert summary["num_requests"] == 6 and summary["plots"] == [] and "config" not in summary
    r = summary["results"][server.frontend.url]
    assert r["model"] == "tiny" and "config" not in r  # the server's name for its model, from /v1/models
    assert summary["slo"] == {"ttft_ms": 60000, "itl_ms": None} and summary["vocab_size"] == VOCAB
    assert summary["rate"] == 0 and summary["versions"]["torch"] and summary["versions"]["python"]
    assert r["goodput_rps"] == pytest.approx(r["requests_per_s"])  # a 60 s TTFT SLO: every request is good
    assert "| target |" in capsys.readouterr().out


def test_cli_remote_rejects_sweep(server, tmp_path):
    with pytest.raises(SystemExit, match="in-process only"):
        cli.main(["--url", server.frontend.url, "--sweep", "max_num_batched_tokens=16,32", "--out", str(tmp_path)])


def in_process(tmp_path, *args) -> dict:
    cli.main(["--config", str(REPO / "config.toml"), "--set", "model=tiny-random", "--set", "num_blocks=256",
              "--out", str(tmp_path), *args])
    return json.loads((tmp_path / "results.json").read_text())


def test_cli_in_process_three_policies(tmp_path):
    summary = in_process(tmp_path, "--num-requests", "8", "--policies", "static,continuous,chunked")
    check_schema(summary, ["static", "continuous", "chunked"], TAGGED_KEYS | STEP_KEYS)
    assert all(r["config"]["model"]["model"] == "tiny-random" for r in summary["results"].values())
    assert [r["config"]["scheduler"]["policy"] for r in summary["results"].values()] == ["static", "continuous", "chunked"]
    assert summary["continuous_over_static_throughput"] > 0
    assert "chunked_over_continuous" not in summary  # spike only
    assert sorted(Path(p).name for p in summary["plots"]) == ["itl_over_time.png", "step_composition.png", "ttft_cdf.png"]
    assert all(Path(p).stat().st_size > 1000 for p in summary["plots"])
    reqs = workload.make("mixed", 0, 8, 0.0, VOCAB)
    for name, r in summary["results"].items():
        assert r["output_tokens"] == sum(q.max_tokens for q in reqs)
        # every step recorded, the last one included: each prompt token once, each output token
        # but the last fed back once (the prompts are random: no prefix-cache hits)
        work = sum(len(q.prompt_token_ids) + q.max_tokens - 1 for q in reqs)
        assert r["tokens_processed"] - r["padding_waste_pct"] / 100 * r["tokens_processed"] == pytest.approx(work)
        assert (r["padding_waste_pct"] > 0) == (name == "static")


def test_cli_sweep_refuses_a_value_given_twice(tmp_path):
    """Runs are named by their value: a repeat used to replace the first run's row, silently."""
    with pytest.raises(SystemExit, match="--sweep kv_cache_dtype: 'auto' given more than once"):
        cli.main(["--sweep", "kv_cache_dtype=auto,float16,auto", "--no-plots", "--out", str(tmp_path)])


def test_cli_sweep(tmp_path):
    summary = in_process(tmp_path, "--num-requests", "4", "--policies", "chunked",
                         "--sweep", "max_num_batched_tokens=16,32")
    assert list(summary["results"]) == ["chunked max_num_batched_tokens=16", "chunked max_num_batched_tokens=32"]
    assert [Path(p).name for p in summary["plots"]] == ["sweep_max_num_batched_tokens.png"]
    assert Path(summary["plots"][0]).stat().st_size > 1000
    # a smaller budget takes more steps for the same work
    a, b = summary["results"].values()
    assert a["num_steps"] > b["num_steps"] and a["tokens_processed"] == b["tokens_processed"]


def fake_server_run(chunks: list[dict], requests: int = 1):
    """run_remote against a stub that streams `chunks` as SSE (then [DONE]) for any completion."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
            await asyncio.sleep(0.005)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            return await run_remote(f"http://{host}:{port}", "m", [workload.BenchRequest([1, 2], 8, 0.0)] * requests)
        finally:
            await runner.cleanup()

    timings, _ = asyncio.run(go())
    return timings


def text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def test_remote_counts_content_chunks():
    # a token with no text yet still counts; a finish-only chunk does not
    [t] = fake_server_run([text("a"), text(""), text("bc"), text("", "length")])
    assert t.ok and t.num_output_tokens == 3 and len(t.token_times) == 3 and t.first_token == t.token_times[0]
    [t] = fake_server_run([text("a"), text("b", "length")])  # the last token rides on the finish chunk
    assert t.ok and t.num_output_tokens == 2


def test_remote_prefers_usage():
    [t] = fake_server_run([text("ab"), text("cd", "length"), {"choices": [], "usage": {"completion_tokens": 8}}])
    assert t.ok and len(t.token_times) == 2 and t.num_output_tokens == 8
    assert t.tpot == pytest.approx((t.token_times[1] - t.token_times[0]) / 7)


def test_remote_fails_a_request_that_stopped_short():
    """Every request asks for max_tokens (8) with ignore_eos: a server that stops earlier did less
    work than the other targets, and its request used to count as done."""
    [t] = fake_server_run([text("ab"), text("cd", "stop")])
    assert not t.ok and "finish_reason 'stop' after 2 of 8 tokens" in t.error and "ignore_eos" in t.error
    [t] = fake_server_run([text("ab"), text("cd", "length"), {"choices": [], "usage": {"completion_tokens": 7}}])
    assert not t.ok and "after 7 of 8 tokens" in t.error


def test_remote_detects_broken_streams():
    [t] = fake_server_run([text("a"), text("b")])  # [DONE] without any finish_reason
    assert not t.ok and "finish_reason" in t.error
    [t] = fake_server_run([text("a"), {"error": {"message": "boom"}}])
    assert not t.ok and "boom" in t.error
