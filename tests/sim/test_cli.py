"""engine-bench writes a run's trace and steps; engine-sim calibrates from the steps and replays
the trace (tiny random model for the real run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import cli as bench_cli
from engine.sim import cli
from engine.sim import trace as traces
from engine.sim.calibration import Calibration
from tests.sim.util import CAL

REPO = Path(__file__).resolve().parents[2]
RUN = ["--config", str(REPO / "config.toml"), "--set", "num_blocks=256"]  # the model is the calibration's
COMMON = [*RUN, "--set", "model=tiny-random"]


def test_bench_trace_and_steps_calibrate_and_replay(tmp_path, capsys):
    bench_cli.main([*COMMON, "--workload", "mixed", "--num-requests", "8", "--policies", "chunked", "--no-plots",
                    "--out", str(tmp_path / "bench"), "--save-trace", str(tmp_path / "trace.jsonl"),
                    "--save-steps", str(tmp_path / "steps.jsonl")])
    real = json.loads((tmp_path / "bench" / "results.json").read_text())["results"]["chunked"]
    trace = traces.load(tmp_path / "trace.jsonl")
    assert len(trace) == 8 and sum(r.output_tokens for r in trace) == real["output_tokens"]
    cli.main(["calibrate", *COMMON, "--steps", str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "cal.json")])
    cal = Calibration.load(tmp_path / "cal.json")
    assert cal.model == "tiny-random" and cal.dtype == "float32" and cal.cpu["model"] and cal.num_steps == real["num_steps"]
    assert cal.kv_cache_dtype == "float32"  # "auto": the model's
    cli.main(["calibrate", *COMMON, "--set", "kv_cache_dtype=float16", "--steps", str(tmp_path / "steps.jsonl"),
              "--out", str(tmp_path / "cal16.json")])  # as for steps of a float16-KV run: recorded as said
    assert Calibration.load(tmp_path / "cal16.json").kv_cache_dtype == "float16"
    cli.main(["run", *RUN, "--set", "policy=chunked", "--calibration", str(tmp_path / "cal.json"),
              "--trace", str(tmp_path / "trace.jsonl"), "--out", str(tmp_path / "sim")])
    summary = json.loads((tmp_path / "sim" / "results.json").read_text())
    sim = summary["results"]["chunked"]
    assert sim["output_tokens"] == real["output_tokens"] and sim["num_failed"] == 0
    # same trace, same policy and pool: the same work (each prompt token once, no preemption here)
    assert sim["tokens_processed"] == real["tokens_processed"]
    assert sorted(Path(p).name for p in summary["plots"]) == ["itl_over_time.png", "step_composition.png", "ttft_cdf.png"]
    captured = capsys.readouterr()
    assert "| chunked |" in captured.out and "simulated/wall" in captured.out
    assert "without step noise" not in captured.err  # a fresh calibration has its step ratios


def test_sweep_with_goodput(tmp_path, capsys):
    CAL.save(tmp_path / "cal.json")
    cli.main(["run", *RUN, "--calibration", str(tmp_path / "cal.json"), "--workload", "sharegpt-like",
              "--rate", "2", "--duration-s", "20", "--slo-ttft-ms", "3000", "--slo-itl-ms", "400", "--goodput",
              "--sweep", "replicas=1,2", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "results.json").read_text())
    one, two = (summary["results"][f"replicas={n}"] for n in (1, 2))
    assert 0 < one["goodput_rate"] < two["goodput_rate"]
    assert all(g["bounded"] for g in summary["goodput"].values())
    assert sorted(Path(p).name for p in summary["plots"]) == ["goodput_replicas.png", "sweep_replicas.png"]
    assert "has no step ratios" in capsys.readouterr().err  # CAL predates them: said, not silently ignored


def test_goodput_over_a_duration_needs_no_rate(tmp_path):
    """The README's command: the search sets the rate, and the base run starts at its first one."""
    CAL.save(tmp_path / "cal.json")
    cli.main(["run", *RUN, "--calibration", str(tmp_path / "cal.json"), "--workload", "sharegpt-like",
              "--duration-s", "10", "--slo-ttft-ms", "3000", "--goodput", "--goodput-start", "0.5", "--no-plots",
              "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["trace"]["rate"] == 0.5 and summary["num_requests"] == 5
    assert next(iter(summary["results"].values()))["goodput_rate"] > 0


@pytest.mark.parametrize("args, why", [
    (["--sweep", "no_such_key=1,2"], "unknown config key"),
    (["--set", "policy=fifo"], "policy"),
    (["--goodput", "--slo-ttft-ms", "100"], "--duration-s"),
    (["--goodput"], "--slo"),
    (["--sweep", "router=random"], "router"),
    (["--set", "kv_cache_dtype=float16"], "--set kv_cache_dtype: the simulator takes step times from the calibration"),
    (["--set", "dtype=bfloat16"], "--set dtype: .*calibrate with it"),
    (["--sweep", "weight_format=gguf,dequantized"], "--sweep weight_format: the simulator takes step times"),
    (["--sweep", "max_step_ms=200,400,200"], "--sweep max_step_ms: '200' given more than once"),
    (["--set", "port=1"], "--set port: the simulator runs no HTTP server and no Ray processes"),
    (["--sweep", "replica_cpus=1,2"], "--sweep replica_cpus: the simulator runs no HTTP server"),
    (["--set", "enable_prefix_caching=ture"], "'enable_prefix_caching': bad value 'ture'"),
])
def test_refusals(tmp_path, args, why):
    CAL.save(tmp_path / "cal.json")
    with pytest.raises(SystemExit, match=why):
        cli.main(["run", *RUN, "--calibration", str(tmp_path / "cal.json"), "--out", str(tmp_path), *args])


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["calibrate", "--help"]], ids=" ".join)
def test_help_is_printed(argv, capsys):
    """argparse formats help strings with %: a stray one only fails when --help is asked for."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert "usage: " in capsys.readouterr().out
