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
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sim.calibration import Calibration, load_steps, record_shape  # noqa: E402

FIGURES = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p99")
GOAL, LIMIT = 0.10, 0.15  # the goal and bound on each figure's error


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True)
    p.add_argument("--workloads", default="mixed,spike-overlap,sharegpt-like")
    p.add_argument("--policies", default="continuous,chunked")
    p.add_argument("--num-requests", type=int, help="default: each workload's own")
    p.add_argument("--rate", type=float, default=0.0, help="sharegpt-like / mixed arrivals per second (0 = at once)")
    p.add_argument("--config", default="config.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="sim-accuracy")
    p.add_argument("--no-step-noise", action="store_true", help="simulate each step at exactly its prediction")
    p.add_argument("--sim-seeds", type=int, default=5,
                   help="simulate each trace with this many noise seeds; each figure is their median")
    p.add_argument("--reuse-real", action="store_true",
                   help="keep the real runs already in --out (trace, steps, results) and redo only the simulation")
    args = p.parse_args()
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


def compare(args, workload: str, policy: str, d: Path) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    common = ["--config", args.config, *sum((["--set", s] for s in args.set), [])]
    sizing = (["--num-requests", str(args.num_requests)] if args.num_requests else [])
    rate = ["--rate", str(args.rate)] if args.rate and not workload.startswith("spike") else []
    trace, steps, real_dir, sim_dir = d / "trace.jsonl", d / "steps.jsonl", d / "real", d / "sim"
    if not (args.reuse_real and (real_dir / "results.json").exists() and trace.exists() and steps.exists()):
        subprocess.run([sys.executable, "-m", "engine.bench.cli", *common, "--workload", workload, "--policies",
                        policy, *sizing, *rate, "--no-plots", "--out", str(real_dir), "--save-trace", str(trace),
                        "--save-steps", str(steps)], check=True)
    sims = []
    for seed in range(args.sim_seeds):  # with a trace, the seed draws only the step noise
        sim_out = sim_dir / f"seed{seed}"
        subprocess.run([sys.executable, "-m", "engine.sim.cli", "run", *common, "--set", f"policy={policy}",
                        "--calibration", args.calibration, "--trace", str(trace), "--no-plots", "--out", str(sim_out),
                        "--seed", str(seed), *(["--no-step-noise"] if args.no_step_noise else [])], check=True)
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
    return statistics.median_high(xs) if xs else None


def step_error(cal: Calibration, records: list) -> float | None:
    """Median |calibrated - measured| / measured forward time over the real run's steps: how much
    of a figure's error is the cost model's, rather than the simulation's."""
    errors = sorted(abs(cal.forward_s(record_shape(r)) - r.forward_s) / r.forward_s
                    for r in records if not r.is_idle and r.error is None and r.forward_s > 0)
    return errors[len(errors) // 2] if errors else None


if __name__ == "__main__":
    main()
