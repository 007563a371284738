"""Simulator accuracy: real engine-bench runs vs engine-sim on the same traces, error per figure.

    python examples/sim_accuracy.py --calibration calibration.json
    python examples/sim_accuracy.py --calibration c.json --workloads mixed --policies chunked --out acc-out

For each workload and policy: run engine-bench for real (in-process, saving its trace: when each
request was actually sent), replay that trace through engine-sim with the same config (with
step noise, once per seed of --sim-seeds: each simulated figure is the median over the seeds),
and print each figure and its relative error |sim - real| / real. The calibration should come from a
different run than the ones checked (`engine-sim calibrate --run` or `--steps` of another bench
run), on the same machine, model and dtype. Run on a quiet machine: a figure of a loaded machine
is the load's, not the engine's. Writes accuracy.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench.workload import WORKLOADS  # noqa: E402
from engine.config import POLICIES, ClusterConfig, EngineConfig, config_path, parse_value  # noqa: E402
from engine.sim.calibration import Calibration, load_steps, record_shape  # noqa: E402
from engine.sim.cli import CALIBRATED_KEYS, SIM_KEYS, UNSIMULATED_KEYS  # noqa: E402

FIGURES = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p99")
GOAL, LIMIT = 0.10, 0.15  # the goal and bound on each figure's error
CLUSTER_KEYS = tuple(f.name for f in dataclasses.fields(ClusterConfig))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True)
    p.add_argument("--workloads", default="mixed,spike-overlap,sharegpt-like")
    p.add_argument("--policies", default="continuous,chunked")
    p.add_argument("--num-requests", type=positive_int, help="default: each workload's own")
    p.add_argument("--rate", type=float, default=0.0, help="sharegpt-like / mixed arrivals per second (0 = at once)")
    p.add_argument("--config", help="default: ./config.toml when there is one, else the built-in defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="sim-accuracy")
    p.add_argument("--no-step-noise", action="store_true", help="simulate each step at exactly its prediction")
    p.add_argument("--sim-seeds", type=positive_int, default=5,
                   help="simulate each trace with this many noise seeds; each figure is their median")
    p.add_argument("--reuse-real", action="store_true",
                   help="keep the real runs already in --out (trace, steps, results) and redo only the simulation")
    args = p.parse_args()
    check_args(p, args)  # before the real runs: a flag engine-sim refuses would fail only after them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for wl in args.workloads.split(","):
        for policy in args.policies.split(","):
            rows.append(compare(args, wl, policy, out / f"{wl}-{policy}"))
    print(f"\nload 1m now {os.getloadavg()[0]:.2f}; error = |sim - real| / real; goal {GOAL:.0%}, bound {LIMIT:.0%}\n")
    print("| workload | policy | " + " | ".join(f"{f} real / sim / err" for f in FIGURES) + " | step err p50 |")
    print("|---|---|" + "---:|" * (len(FIGURES) + 1))
    worst = 0.0
    for r in rows:
        cells = []
        for f in FIGURES:
            real, sim, err = r["real"].get(f), r["sim"].get(f), r["error"].get(f)
            worst = max(worst, err) if err is not None else worst
            cells.append("–" if err is None else f"{real:.0f} / {sim:.0f} / {err:.1%}")
        step = "–" if r["step_error_p50"] is None else f"{r['step_error_p50']:.1%}"
        print(f"| {r['workload']} | {r['policy']} | " + " | ".join(cells) + f" | {step} |")
    print(f"\nworst error {worst:.1%} ({'within' if worst <= LIMIT else 'OVER'} the {LIMIT:.0%} bound)")
    (out / "accuracy.json").write_text(json.dumps(rows, indent=2))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Refuse up front what engine-bench or engine-sim would refuse after minutes of real runs."""
    for flag, given, known in (("--workloads", args.workloads, WORKLOADS), ("--policies", args.policies, POLICIES)):
        unknown = [name for name in given.split(",") if name not in known]
        if unknown:
            p.error(f"{flag}: unknown {', '.join(map(repr, unknown))} (known: {', '.join(sorted(known))})")
    if not math.isfinite(args.rate) or args.rate < 0:
        p.error(f"--rate must be >= 0, got {args.rate}")
    if not Path(args.calibration).is_file():
        p.error(f"--calibration {args.calibration}: no such file")
    if args.config is not None and not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    overrides = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            p.error(f"--set wants KEY=VALUE, got {item!r}")
        if key == "policy":
            p.error("--set policy: use --policies (each run sets its own policy)")
        if key in UNSIMULATED_KEYS:
            p.error(f"--set {key}: engine-sim refuses it (the simulator runs no HTTP server and no Ray processes, "
                    f"so {key} would change nothing there)")
        if key in SIM_KEYS or key in CLUSTER_KEYS:
            p.error(f"--set {key}: the real run is one engine in this process, so {key} would change nothing")
        if key in CALIBRATED_KEYS:
            p.error(f"--set {key}: engine-sim refuses it (step times come from --calibration, which {key} does "
                    f"not change); set it in --config for the real runs and calibrate with the same value")
        try:
            overrides[key] = parse_value(key, value)
        except ValueError as e:
            p.error(f"--set {item}: {e}")
    try:
        EngineConfig.load(config_path(args.config), **overrides)
    except (ValueError, OSError) as e:
        p.error(f"the config with --set: {e}")


def run(cmd: list[str], what: str) -> None:
    """Run an engine-bench / engine-sim subprocess (its own errors go to stderr); exit with one
    line naming it if it fails."""
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise SystemExit(f"sim_accuracy: {what} failed (exit {rc}); its message is above")


def compare(args, workload: str, policy: str, d: Path) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    common = [*(["--config", args.config] if args.config else []), *sum((["--set", s] for s in args.set), [])]
    sizing = (["--num-requests", str(args.num_requests)] if args.num_requests else [])
    rate = ["--rate", str(args.rate)] if args.rate and not workload.startswith("spike") else []
    trace, steps, real_dir, sim_dir = d / "trace.jsonl", d / "steps.jsonl", d / "real", d / "sim"
    if not (args.reuse_real and (real_dir / "results.json").exists() and trace.exists() and steps.exists()):
        run([sys.executable, "-m", "engine.bench.cli", *common, "--workload", workload, "--policies", policy,
             *sizing, *rate, "--no-plots", "--out", str(real_dir), "--save-trace", str(trace), "--save-steps",
             str(steps)], f"engine-bench ({workload}, {policy})")
    sims = []
    for seed in range(args.sim_seeds):  # with a trace, the seed draws only the step noise
        sim_out = sim_dir / f"seed{seed}"
        run([sys.executable, "-m", "engine.sim.cli", "run", *common, "--replicas", "1",  # the real run's one engine
             "--set", f"policy={policy}", "--calibration",
             args.calibration, "--trace", str(trace), "--no-plots", "--out", str(sim_out), "--seed", str(seed),
             *(["--no-step-noise"] if args.no_step_noise else [])], f"engine-sim ({workload}, {policy}, seed {seed})")
        sims.append(json.loads((sim_out / "results.json").read_text())["results"][policy])
    real = json.loads((real_dir / "results.json").read_text())["results"][policy]
    sim = {f: median([s.get(f) for s in sims]) for f in FIGURES}
    error = {}
    for f in FIGURES:
        a, b = real.get(f), sim.get(f)
        error[f] = abs(b - a) / a if a and b is not None and math.isfinite(a) and math.isfinite(b) else None
    return {"workload": workload, "policy": policy, "real": {f: real.get(f) for f in FIGURES},
            "sim": {f: sim.get(f) for f in FIGURES}, "error": error,
            "step_error_p50": step_error(Calibration.load(args.calibration), load_steps(steps))}


def median(values: list) -> float | None:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(xs) if xs else None


def step_error(cal: Calibration, records: list) -> float | None:
    """Median |calibrated - measured| / measured forward time over the real run's steps: how much
    of a figure's error is the cost model's, rather than the simulation's."""
    errors = [abs(cal.forward_s(record_shape(r)) - r.forward_s) / r.forward_s
              for r in records if not r.is_idle and r.error is None and r.forward_s > 0]
    return statistics.median(errors) if errors else None


if __name__ == "__main__":
    main()
