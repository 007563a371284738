"""engine-bench writes a run's trace and steps; engine-sim calibrates from the steps and replays
the trace (tiny random model for the real run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from engine.bench import cli as bench_cli
from engine.sim import cli
from engine.sim import trace as traces
from engine.sim.calibration import Calibration
from engine.sim.simulator import simulate
from tests.sim.util import CAL, config

REPO = Path(__file__).resolve().parents[2]
RUN = ["--config", str(REPO / "config.toml"), "--set", "num_blocks=256"]  # the model is the calibration's
COMMON = [*RUN, "--set", "model=tiny-random"]
CALIBRATE = ["--config", str(REPO / "config.toml"), "--set", "model=tiny-random"]  # --steps: num_blocks changes nothing


def test_bench_trace_and_steps_calibrate_and_replay(tmp_path, capsys):
    bench_cli.main([*COMMON, "--workload", "mixed", "--num-requests", "8", "--policies", "chunked", "--no-plots",
                    "--out", str(tmp_path / "bench"), "--save-trace", str(tmp_path / "trace.jsonl"),
                    "--save-steps", str(tmp_path / "steps.jsonl")])
    real = json.loads((tmp_path / "bench" / "results.json").read_text())["results"]["chunked"]
    trace = traces.load(tmp_path / "trace.jsonl")
    assert len(trace) == 8 and sum(r.output_tokens for r in trace) == real["output_tokens"]
    cli.main(["calibrate", *CALIBRATE, "--steps", str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "cal.json")])
    cal = Calibration.load(tmp_path / "cal.json")
    assert cal.model == "tiny-random" and cal.dtype == "float32" and cal.cpu["model"] and cal.num_steps == real["num_steps"]
    assert cal.kv_cache_dtype == "float32"  # "auto": the model's
    cli.main(["calibrate", *CALIBRATE, "--set", "kv_cache_dtype=float16", "--steps", str(tmp_path / "steps.jsonl"),
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
    # keys of the prefix router alone, where nothing routes by prefix, would change nothing
    (["--router", "round-robin", "--set", "prefix_min_share=0.2"],
     "--set prefix_min_share: only the prefix-affinity router reads it, and the router here is round-robin"),
    (["--router", "least-loaded", "--sweep", "balance_abs_threshold=1,2"],
     "--sweep balance_abs_threshold: only the prefix-affinity router"),
    (["--sweep", "router=round-robin,least-loaded", "--set", "balance_rel_threshold=2"],
     "--set balance_rel_threshold: .* the router here is least-loaded and round-robin"),
    (["--config", "/nonexistent/config.toml"], "--config /nonexistent/config.toml: No such file or directory"),
    (["--rate", "1e308", "--duration-s", "10"], "--rate x --duration-s: .* = inf requests, more than the 10,000,000"),
    (["--trace", "t.jsonl", "--rate", "2"], "--rate: --trace replays its file's requests at their own times"),
    (["--trace", "t.jsonl", "--num-requests", "4"], "--num-requests: --trace replays"),
    (["--rate", "1", "--duration-s", "5", "--num-requests", "4"], "--num-requests: --duration-s sets the number"),
    (["--cv", "2"], "--cv shapes gamma arrivals: add --arrival gamma"),
    # flags that changed nothing and were taken silently
    (["--goodput-start", "2"], "--goodput-start: only the --goodput search reads it"),
    (["--arrival", "gamma"], "--arrival gamma: without a --rate > 0 every request arrives at once"),
    (["--arrival", "gamma", "--rate", "0"], "--arrival gamma: without a --rate > 0"),
    (["--workload", "spike", "--arrival", "poisson"], "--arrival poisson: without a --rate > 0 .* spike"),
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


def _run_summary(tmp_path, *args) -> dict:
    cli.main(["run", "--calibration", str(tmp_path / "cal.json"), "--workload", "mixed", "--num-requests", "4",
              "--no-plots", "--out", str(tmp_path / "sim"), *args])
    return json.loads((tmp_path / "sim" / "results.json").read_text())


def test_the_cluster_is_the_config_s_unless_flags_say_otherwise(tmp_path):
    """[cluster] replicas and router were ignored (1 replica, round-robin) while results.json's
    config said otherwise."""
    CAL.save(tmp_path / "cal.json")
    four = tmp_path / "four.toml"
    four.write_text('[cluster]\nreplicas = 4\nrouter = "least-loaded"\n')
    summary = _run_summary(tmp_path, "--config", str(four))
    (result,) = summary["results"].values()
    assert (result["replicas"], result["router"], len(result["routed"])) == (4, "least-loaded", 4)
    assert result["config"]["cluster"]["replicas"] == 4 and result["config"]["cluster"]["router"] == "least-loaded"
    summary = _run_summary(tmp_path, "--config", str(four), "--replicas", "2", "--router", "prefix-affinity")
    (result,) = summary["results"].values()
    assert (result["replicas"], result["router"], len(result["routed"])) == (2, "prefix-affinity", 2)
    assert result["config"]["cluster"]["replicas"] == 2 and result["config"]["cluster"]["router"] == "prefix"
    one = tmp_path / "one.toml"
    one.write_text("[cluster]\nreplicas = 0\n")  # engine-serve's one engine in its own process: one replica
    summary = _run_summary(tmp_path, "--config", str(one), "--set", "balance_abs_threshold=4")
    (result,) = summary["results"].values()
    assert (result["replicas"], result["router"]) == (1, "prefix-affinity")  # the config's default router, "prefix"
    assert result["config"]["cluster"]["replicas"] == 1 and result["config"]["cluster"]["balance_abs_threshold"] == 4


@pytest.mark.parametrize("args, why", [
    (["run", "--replicas", "0"], "argument --replicas: must be >= 1, got 0"),
    (["run", "--replicas", "-2"], "argument --replicas: must be >= 1, got -2"),
    (["run", "--rate", "inf"], "argument --rate: must be a finite number, got inf"),
    (["run", "--rate", "nan"], "argument --rate: must be a finite number, got nan"),
    (["run", "--rate", "-1"], "argument --rate: must be >= 0, got -1"),
    (["run", "--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
    (["run", "--num-requests", "-3"], "argument --num-requests: must be >= 1, got -3"),
    (["run", "--rate", "1", "--duration-s", "0"], "argument --duration-s: must be > 0, got 0"),
    (["run", "--rate", "1", "--duration-s", "-1"], "argument --duration-s: must be > 0, got -1"),
    (["calibrate", "--steps", "s.jsonl", "--max-model-len", "-5"], "argument --max-model-len: must be >= 1, got -5"),
    (["calibrate", "--steps", "s.jsonl", "--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["calibrate", "--steps", "s.jsonl", "--split-rows", "-1"], "argument --split-rows: must be >= 0, got -1"),
    (["calibrate", "--steps", "s.jsonl", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_meaningless_flag_values_are_argparse_errors(args, why, tmp_path, capsys):
    """They were tracebacks (--replicas 0, --rate inf), or ran as something else (--num-requests 0:
    the default; -3: no requests, exit 0; --max-model-len 0: unlimited)."""
    calibration = ["--calibration", str(tmp_path / "cal.json"), "--out", str(tmp_path)] if args[0] == "run" else []
    with pytest.raises(SystemExit) as e:
        cli.main([*args, *calibration])
    assert e.value.code == 2
    assert f"engine-sim {args[0]}: error: {why}" in capsys.readouterr().err


def test_unreadable_traces_are_named(tmp_path):
    """A missing file or a directory were tracebacks; malformed JSON gave no file nor line."""
    CAL.save(tmp_path / "cal.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}\n{"arrival_s": 0, oops}\n')
    for path, why in ((tmp_path / "missing.jsonl", "No such file or directory"), (tmp_path, "Is a directory"),
                      (bad, "trace line 2: JSON is malformed")):
        with pytest.raises(SystemExit, match=f"^--trace {re.escape(str(path))}: {why}"):
            cli.main(["run", "--calibration", str(tmp_path / "cal.json"), "--trace", str(path), "--out", str(tmp_path)])


def test_calibrate_from_steps_records_the_model_it_is_told(tmp_path):
    """A steps file does not say which model ran it: the config's default was recorded as if it had."""
    steps = simulate(traces.generate("mixed", 1, 16, 4.0), config(policy="chunked"), CAL, keep_steps=True).steps
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(s) + b"\n" for s in steps))
    calibrate = ["calibrate", "--steps", str(path), "--out", str(tmp_path / "cal.json")]
    with pytest.raises(SystemExit, match="--model: a steps file does not say which model ran it"):
        cli.main(calibrate)
    with pytest.raises(SystemExit, match="--set router: calibrate runs one engine in this process"):
        cli.main([*calibrate, "--model", "m", "--set", "router=least-loaded"])
    with pytest.raises(SystemExit, match="--config /nonexistent/config.toml: No such file"):
        cli.main([*calibrate, "--model", "m", "--config", "/nonexistent/config.toml"])
    cli.main([*calibrate, "--model", "smollm2-360m"])
    assert Calibration.load(tmp_path / "cal.json").model == "smollm2-360m"


@pytest.mark.parametrize("args", [["--workload", "spike"], ["--num-requests", "8"], ["--set", "num_blocks=256"],
                                  ["--set", "max_step_ms=400"]], ids=" ".join)
def test_calibrate_refuses_run_flags_without_run(args, tmp_path):
    """They shape `--run`'s real run; with --steps alone they were accepted and changed nothing."""
    flag = f"--set {args[1].partition('=')[0]}" if args[0] == "--set" else args[0]
    with pytest.raises(SystemExit, match=f"^{flag}: only --run reads it"):
        cli.main(["calibrate", "--steps", "s.jsonl", "--model", "m", "--out", str(tmp_path / "c.json"), *args])


def _trace_summary(tmp_path, trace) -> dict:
    cli.main(["run", "--calibration", str(tmp_path / "cal.json"), "--trace", str(trace), "--set", "num_blocks=1024",
              "--no-plots", "--out", str(tmp_path / "sim")])
    return json.loads((tmp_path / "sim" / "results.json").read_text())


def test_no_context_limit_is_said(tmp_path, capsys):
    """A calibration without max_model_len ran an 8,500-token request silently, where intake refuses it."""
    long = tmp_path / "long.jsonl"
    long.write_text('{"arrival_s": 0, "prompt_tokens": 8400, "output_tokens": 100}\n')
    CAL.save(tmp_path / "cal.json")
    summary = _trace_summary(tmp_path, long)
    assert summary["calibration"]["max_model_len"] is None
    assert "has no max_model_len: no context limit is applied" in capsys.readouterr().err
    msgspec.structs.replace(CAL, max_model_len=8192).save(tmp_path / "cal.json")
    summary = _trace_summary(tmp_path, long)
    (result,) = summary["results"].values()
    assert summary["calibration"]["max_model_len"] == 8192 and result["num_failed"] == 1
    assert "no context limit" not in capsys.readouterr().err


def test_results_record_the_seed_step_noise_and_each_run_s_config(tmp_path):
    """A trace run recorded neither --seed nor --step-noise (both shape its figures), and a sweep's
    runs all showed the base config."""
    CAL.save(tmp_path / "cal.json")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 40, "output_tokens": 5}\n')
    cli.main(["run", "--calibration", str(tmp_path / "cal.json"), "--trace", str(trace), "--seed", "7",
              "--no-step-noise", "--sweep", "max_num_seqs=2,4", "--no-plots", "--out", str(tmp_path / "sim")])
    summary = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert (summary["seed"], summary["step_noise"]) == (7, False) and summary["versions"]["python"]
    assert [r["config"]["scheduler"]["max_num_seqs"] for r in summary["results"].values()] == [2, 4]


def test_results_config_is_the_calibration_s_model(tmp_path, capsys):
    """--config's [model] keys reached results.json (gemma3-270m, KV float16) while the step times
    simulated were the calibration's (here "fake", float32)."""
    CAL.save(tmp_path / "cal.json")
    other = tmp_path / "other.toml"
    other.write_text('[model]\nmodel = "gemma3-270m"\n\n[cache]\nkv_cache_dtype = "float16"\n')
    summary = _run_summary(tmp_path, "--config", str(other))
    (result,) = summary["results"].values()
    model, cache = result["config"]["model"], result["config"]["cache"]
    assert (model["model"], model["dtype"], cache["kv_cache_dtype"]) == ("fake", "float32", "auto")
    assert (f"{other}: model = gemma3-270m, kv_cache_dtype = float16 not simulated: step times are the "
            "calibration's (fake, float32, KV ?)") in capsys.readouterr().err  # CAL predates the KV dtype: the model's
    same = tmp_path / "same.toml"
    same.write_text('[model]\nmodel = "fake"\n')
    summary = _run_summary(tmp_path, "--config", str(same))
    (result,) = summary["results"].values()
    assert result["config"]["model"]["model"] == "fake" and "not simulated" not in capsys.readouterr().err
