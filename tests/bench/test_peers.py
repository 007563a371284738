"""The transformers peers on the tiny model: every request ok with exactly max_tokens timed
tokens, static batches in arrival order, greedy ids equal to plain `generate` and to our engine,
EOS ignored, the model left as it was; and `--peer` in the CLI.

transformers calls run in a worker thread, as engine-bench runs them (`asyncio.to_thread`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.bench import cli, peers, workload
from engine.cpu import cpu_info
from engine.bench.arrivals import Arrivals
from engine.bench.workload import BenchRequest
from engine.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
# 18 short requests at once: two static batches of 16 and 2; every max_tokens from 3 to 8
REQUESTS = [BenchRequest([100 + (7 * i + j) % 150 for j in range(4 + i % 9)], 3 + i % 6, 0.0, "short")
            for i in range(18)]


def in_thread(fn, *args):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def plain_generate(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    ids = in_thread(lambda: [plain_generate(tiny_model.hf_model, r.prompt_token_ids, r.max_tokens) for r in REQUESTS])
    assert [len(x) for x in ids] == [r.max_tokens for r in REQUESTS]  # no EOS in these: plain generate runs to the end
    return ids


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict[str, peers.PeerRun]:
    return {name: in_thread(peers.run, name, tiny_model, REQUESTS, peers.PeerSettings()) for name in peers.PEERS}


@pytest.mark.parametrize("name", peers.PEERS)
def test_every_token_is_timed(runs, name):
    run = runs[name]
    assert len(run.timings) == len(REQUESTS) and run.duration > 0
    for r, t in zip(REQUESTS, run.timings):
        assert t.ok, t.error
        assert t.num_prompt_tokens == len(r.prompt_token_ids) and t.tag == "short"
        assert t.num_output_tokens == len(t.token_times) == r.max_tokens
        assert t.token_times == sorted(t.token_times) and t.first_token == t.token_times[0]
        assert 0 < t.ttft <= t.e2e and t.token_times[-1] <= t.end
    assert max(t.end for t in run.timings) - min(t.arrival for t in run.timings) <= run.duration


@pytest.mark.parametrize("name", peers.PEERS)
def test_ids_equal_plain_generate(runs, reference, name):
    assert runs[name].token_ids == reference


def test_static_runs_batches_of_16_in_arrival_order(runs):
    first, second = runs["transformers-static"].timings[:16], runs["transformers-static"].timings[16:]
    for batch in (first, second):  # one generate each: the same step times, delivered together at its end
        assert len({t.end for t in batch}) == 1
        steps = max((t.token_times for t in batch), key=len)  # the longest request's: every step
        assert all(t.token_times == steps[:len(t.token_times)] for t in batch)
    assert second[0].first_token > first[0].end  # request 17 starts once batch 1 has ended
    assert second[0].ttft > first[0].e2e  # and its TTFT counts the wait from its send time


def test_cb_keeps_each_request_s_own_length(runs):
    # all prefilled in one step, then each request decodes until its own max_tokens: a request
    # with more tokens to make ends later
    ends: dict[int, list[float]] = {}
    for r, t in zip(REQUESTS, runs["transformers-cb"].timings):
        ends.setdefault(r.max_tokens, []).append(t.token_times[-1])
    assert all(max(ends[n]) < min(ends[n + 1]) for n in range(3, 8))


def test_model_is_left_as_it_was(tiny_model, runs):
    hf = tiny_model.hf_model
    assert hf.config._attn_implementation == "sdpa" and not hf.training and hf.device.type == "cpu"
    assert hf.generation_config.eos_token_id == 2 and not hasattr(hf, "_cached_continuous_batching_manager")


@pytest.mark.parametrize("name", peers.PEERS)
def test_eos_neither_stops_nor_is_masked(tiny_model, reference, monkeypatch, name):
    # make the first greedy token of request 0 the model's EOS: the peer must still generate it
    # (no masking), and go on to max_tokens (no stop)
    eos = reference[0][0]
    monkeypatch.setattr(tiny_model.hf_model.generation_config, "eos_token_id", eos)
    monkeypatch.setattr(tiny_model.hf_model.config, "eos_token_id", eos)
    run = in_thread(peers.run, name, tiny_model, REQUESTS[:2], peers.PeerSettings())
    assert all(t.ok for t in run.timings) and run.token_ids == reference[:2]


async def test_peers_match_our_engine(tiny_model, runs):
    config = EngineConfig.load(None, model="tiny-random", num_blocks=64, policy="continuous")
    ours = []
    async with Engine(config, loaded=tiny_model) as engine:
        for r in REQUESTS[:3]:
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            ours.append([tok async for out in engine.generate(r.prompt_token_ids, params) for tok in out.token_ids])
    assert all(run.token_ids[:3] == ours for run in runs.values())


def test_gated_requests_wait_for_tokens():
    reqs = [BenchRequest([1], 4, 0.0), BenchRequest([1], 4, 0.0), BenchRequest([1], 2, 0.0, after_tokens=6),
            BenchRequest([1], 2, 0.5, after_tokens=100)]
    a = Arrivals(reqs, start=10.0)
    assert a.due(10.0) == [(0, 10.0), (1, 10.0)] and a.next_at() is None  # both gated requests wait
    a.receive(4, 11.0)
    assert a.due(11.0) == []
    a.receive(4, 12.0)  # 8 >= 6: request 2 is sent now
    assert a.due(12.0) == [(2, 12.0)]
    a.finish(0, 13.0)
    a.finish(1, 14.0)  # every ungated request is done: the last gate opens anyway
    assert a.due(14.0) == [(3, 14.0)] and not a.unsent


def test_static_sends_a_gated_request_when_its_batch_gets_tokens(tiny_model):
    reqs = [BenchRequest([120, 121], 4, 0.0), BenchRequest([122, 123], 2, 0.0, "long", after_tokens=3)]
    run = in_thread(peers.run, "transformers-static", tiny_model, reqs, peers.PeerSettings())
    first, gated = run.timings
    assert first.ok and gated.ok and gated.arrival == first.end < gated.first_token


def test_parse_and_settings():
    assert peers.parse("transformers-static, transformers-cb") == ["transformers-static", "transformers-cb"]
    with pytest.raises(ValueError, match="vllm"):
        peers.parse("transformers-static,vllm")
    with pytest.raises(ValueError, match="batch_size"):
        peers.PeerSettings(batch_size=0)
    s = peers.PeerSettings.from_engine(EngineConfig.load(None, max_num_batched_tokens=128, device="cpu"), 8)
    assert (s.batch_size, s.max_batch_tokens, s.max_requests_per_batch, s.device) == (8, 128, 64, "cpu")


@pytest.mark.parametrize("flag", [["--url", "http://127.0.0.1:9"], ["--sweep", "max_num_batched_tokens=16,32"]])
def test_cli_refuses_peer_with_url_or_sweep(tmp_path, flag):
    with pytest.raises(SystemExit, match="in-process only"):
        cli.main([*flag, "--peer", "transformers-static", "--no-plots", "--out", str(tmp_path)])


def test_cli_refuses_compute_limit_with_url(tmp_path):
    with pytest.raises(SystemExit, match="in-process only"):
        cli.main(["--url", "http://127.0.0.1:9", "--compute-limit", "--no-plots", "--out", str(tmp_path)])


def test_cli_runs_peers_after_the_policies(tmp_path):
    cli.main(["--config", str(REPO / "config.toml"), "--set", "num_blocks=256", "--model", "tiny-random",
              "--workload", "mixed", "--num-requests", "6", "--policies", "continuous",
              "--peer", "transformers-static,transformers-cb", "--compute-limit", "--no-plots", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "results.json").read_text())
    assert list(summary["results"]) == ["continuous", "transformers-static", "transformers-cb"]
    assert summary["cpu"] == cpu_info().as_dict() and summary["load_avg_1m"]["start"] >= 0  # which machine
    assert set(summary["decode_speed_over_peers"]["continuous"]) == {"transformers-static", "transformers-cb"}
    over = summary["throughput_over_peers"]["continuous"]
    cont = summary["results"]["continuous"]["output_tokens_per_s"]
    for p in ("transformers-static", "transformers-cb"):
        assert over[p] == pytest.approx(cont / summary["results"][p]["output_tokens_per_s"])
    limit = summary["compute_limit"]
    assert limit["prefill_tokens_per_s"]["transformers"] > 0 and limit["prefill_tokens_per_s"]["engine"] > 0
    for r in summary["results"].values():
        assert r["limit_fraction"] == pytest.approx(r["output_tokens_per_s"] / limit["output_tokens_per_s_limit"]["transformers"])
    work = sum(r.max_tokens for r in workload.make("mixed", 0, 6, 0.0, 259))
    for name, r in summary["results"].items():
        assert r["num_failed"] == 0 and r["output_tokens"] == work and r["ttft_ms_p50"] > 0
        assert ("num_steps" in r) == (name == "continuous")  # peers have no step records


@pytest.mark.parametrize(("flags", "message"), [
    (["--peer", "foo"], "unknown peer 'foo'; choose from transformers-static, transformers-cb, llama.cpp"),
    (["--policies", "continuous,chunkd"], "--policies: config key 'policy' must be one of"),
])
def test_cli_refuses_an_unknown_peer_or_policy_before_the_model_loads(tmp_path, monkeypatch, flags, message):
    def no_load(*args):
        raise AssertionError("the model loaded before the bad flag was refused")

    monkeypatch.setattr(cli, "load_model", no_load)
    with pytest.raises(SystemExit, match=message):
        cli.main(["--model", "tiny-random", *flags, "--no-plots", "--out", str(tmp_path)])
