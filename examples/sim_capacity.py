"""Capacity planning with engine-sim: goodput vs replicas under two routers, and the largest
step budget that meets an ITL SLO. Needs only a calibration (no model, no torch).

    python examples/sim_capacity.py --calibration calibration.json --out docs/results/sim

Traffic: `sharegpt-like` lengths and Poisson arrivals, each prompt behind one of
`--num-prefixes` system prompts of `--prefix-tokens` tokens (chat traffic: the share a prefix
cache and a prefix-affine router can exploit). Goodput: the highest arrival rate at which >= 90 %
of requests meet both SLOs, each rate probed with `--duration-s` of traffic.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import msgspec

from engine.cli_args import number, numbers, positive_int
from engine.config import EngineConfig
from engine.sim import goodput, trace as traces
from engine.sim.calibration import Calibration
from engine.sim.simulator import ROUTERS, simulate


def chat_trace(seed: int, rate: float, duration_s: float, num_prefixes: int, prefix_tokens: int):
    n = max(1, round(rate * duration_s))
    base = traces.generate("sharegpt-like", seed, n, rate)
    return [msgspec.structs.replace(r, prompt_tokens=r.prompt_tokens + prefix_tokens, prefix_group=i % num_prefixes,
                                    prefix_tokens=prefix_tokens) for i, r in enumerate(base)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True)
    p.add_argument("--config", default="config.toml")
    p.add_argument("--replicas", type=numbers(int, 1), default="1,2,4,8,16,32")
    p.add_argument("--routers", default="round-robin,prefix-affinity")
    p.add_argument("--slo-ttft-ms", type=number(float, 0, strict=True), default=5000)
    p.add_argument("--slo-itl-ms", type=number(float, 0, strict=True), default=1000)
    p.add_argument("--duration-s", type=number(float, 0, strict=True), default=120)
    p.add_argument("--num-prefixes", type=positive_int, default=16)
    p.add_argument("--prefix-tokens", type=number(int, 0), default=400)
    p.add_argument("--step-budgets", type=numbers(int, 0), default="250,500,1000,2000",
                   help="max_step_ms values tried for the ITL SLO (0 = the token budget only)")
    p.add_argument("--abs-thresholds", type=numbers(int, 0), default="", metavar="N,N,...",
                   help="also prefix-affinity with each of these [cluster] balance_abs_threshold values")
    p.add_argument("--out", default="sim-capacity")
    args = p.parse_args()
    unknown = [r for r in args.routers.split(",") if r not in ROUTERS]
    if unknown:
        p.error(f"--routers: unknown {', '.join(map(repr, unknown))} (known: {', '.join(sorted(ROUTERS))})")
    if not args.replicas or not args.step_budgets:
        p.error("--replicas and --step-budgets need at least one value each")
    cal = Calibration.load(args.calibration)
    base = EngineConfig.load(args.config if Path(args.config).exists() else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = (args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    wall = time.perf_counter()

    def rate_for(config, replicas, router):
        def probe(rate):
            tr = chat_trace(0, rate, args.duration_s, args.num_prefixes, args.prefix_tokens)
            return goodput.fraction_meeting(simulate(tr, config, cal, replicas, router).timings, *slo)
        return goodput.find(probe, start=0.25 * replicas, rel_tol=0.05)[0]

    # the step budget: the largest max_step_ms whose single-replica goodput is best under the ITL SLO
    budgets = {ms: rate_for(base.with_overrides(policy="chunked", max_step_ms=ms), 1, "round-robin")
               for ms in args.step_budgets}
    chosen = max(budgets, key=lambda ms: (budgets[ms], ms))
    config = base.with_overrides(policy="chunked", max_step_ms=chosen)
    print(f"max_step_ms -> 1-replica goodput: {budgets}; chosen {chosen}")
    replicas = args.replicas
    curves = {}
    runs = [(router, config, router) for router in args.routers.split(",")]
    runs += [(f"prefix-affinity, abs threshold {t}", config.with_overrides(replicas=1, balance_abs_threshold=t),
              "prefix-affinity") for t in args.abs_thresholds]
    for label, cfg, router in runs:
        curves[label] = [rate_for(cfg, n, router) for n in replicas]
        print(f"{label}: " + ", ".join(f"{n}: {r:.2f}" for n, r in zip(replicas, curves[label])), flush=True)
    summary = {"calibration": {"model": cal.model, "dtype": cal.dtype, "cpu": cal.cpu}, "slo_ms": [args.slo_ttft_ms, args.slo_itl_ms],
               "duration_s": args.duration_s, "prefixes": [args.num_prefixes, args.prefix_tokens],
               "max_step_ms_goodput": budgets, "chosen_max_step_ms": chosen, "replicas": replicas,
               "goodput_rps": curves, "wall_s": time.perf_counter() - wall}
    (out / "capacity.json").write_text(json.dumps(summary, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for router, rates in curves.items():
        a.plot(replicas, rates, "o-", label=router)
    a.set_xscale("log", base=2)
    a.set_xlabel("replicas")
    a.set_ylabel("goodput (req/s)")
    a.set_title(f"goodput, TTFT <= {args.slo_ttft_ms:.0f} ms, ITL <= {args.slo_itl_ms:.0f} ms")
    a.legend()
    b.plot(list(budgets), list(budgets.values()), "s-")
    b.axvline(chosen, color="grey", ls="--")
    b.set_xscale("log", base=2)
    b.set_xlabel("max_step_ms")
    b.set_ylabel("1-replica goodput (req/s)")
    b.set_title("step budget vs goodput")
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=110)
    print(f"wrote {out}/capacity.json and capacity.png in {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
