"""engine-bench: reproduce the three stages with numbers and plots.

    engine-bench --workload mixed --policies static,continuous,chunked
    engine-bench --workload spike --policies continuous,chunked
    engine-bench --workload spike --policies chunked --sweep max_num_batched_tokens=64,128,256,512,1024
    engine-bench --workload mixed --url http://127.0.0.1:8000        # any OpenAI-compatible server

In-process mode runs each policy on a fresh engine (same config otherwise, model loaded
once). Results: a markdown table on stdout, results.json and PNG plots in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tqdm import tqdm

from engine.bench import report, workload
from engine.bench.runner import run_in_process, run_remote
from engine.config import EngineConfig, all_keys
from engine.engine import DTYPES, Engine
from engine.model.loader import load_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed", choices=sorted(workload.WORKLOADS))
    p.add_argument("--policies", default="static,continuous,chunked")
    p.add_argument("--url", help="benchmark a running OpenAI-compatible server instead")
    p.add_argument("--model", help="model name (remote) or model spec (in-process)")
    p.add_argument("--api-key", default="")
    p.add_argument("--config", default="config.toml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0 = all at once")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-itl-ms", type=float)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine config override")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help="run the first policy once per value")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def _coerce(key: str, value: str):
    keys = all_keys()
    if key not in keys:
        raise SystemExit(f"unknown config key {key!r}")
    typ = keys[key][1]
    return value.lower() in ("1", "true", "yes") if typ is bool else typ(value)


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = _coerce(key, value)
    return out


async def _bench(args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, runs = {}, {}
    vocab_size = 20000
    if args.url:
        targets = [(args.url, {})]
    else:
        base = EngineConfig.load(args.config if Path(args.config).exists() else None, **_overrides(args.set))
        if args.model:
            base = base.with_overrides(model=args.model)
        loaded = load_model(base.model.model, base.model.resolved_cache_dir(), DTYPES[base.model.dtype])
        vocab_size = len(loaded.tokenizer)
        policies = args.policies.split(",")
        if args.sweep:
            key, _, values = args.sweep.partition("=")
            targets = [(f"{policies[0]} {key}={v}", {"policy": policies[0], key: _coerce(key, v)}) for v in values.split(",")]
        else:
            targets = [(p, {"policy": p}) for p in policies]
    requests = workload.make(args.workload, args.seed, args.num_requests, args.rate, vocab_size)
    for name, overrides in targets:
        bar = tqdm(total=len(requests), desc=name, unit="req", file=sys.stderr)
        if args.url:
            timings, duration = await run_remote(args.url, args.model, requests, args.api_key, lambda: bar.update())
            steps, start = None, min(t.arrival for t in timings)
        else:
            config = base.with_overrides(**overrides)
            async with Engine(config, loaded=loaded) as engine:
                timings, duration, steps = await run_in_process(engine, requests, lambda: bar.update())
            start = min(t.arrival for t in timings)
        bar.close()
        results[name] = report.result(timings, duration, steps, args.slo_ttft_ms, args.slo_itl_ms)
        runs[name] = {"timings": timings, "steps": steps, "start": start}
    summary = {"workload": args.workload, "seed": args.seed, "num_requests": len(requests), "results": results}
    if not args.url:
        summary["config"] = base.to_dict()
        names = list(results)
        if {"static", "continuous"} <= set(names) and results["static"]["output_tokens_per_s"]:
            summary["continuous_over_static_throughput"] = (
                results["continuous"]["output_tokens_per_s"] / results["static"]["output_tokens_per_s"])
        if {"continuous", "chunked"} <= set(names) and "steady_itl_ms_max" in results["chunked"]:
            c, k = results["continuous"], results["chunked"]
            summary["chunked_over_continuous"] = {
                "steady_itl_max": k["steady_itl_ms_max"] / c["steady_itl_ms_max"],
                "steady_itl_p99": k["steady_itl_ms_p99"] / c["steady_itl_ms_p99"],
                "long_ttft": k["long_ttft_ms_max"] / c["long_ttft_ms_max"],
            }
    plots = []
    if not args.no_plots:
        if args.sweep:
            key, _, values = args.sweep.partition("=")
            plots.append(report.plot_sweep(key, [_coerce(key, v) for v in values.split(",")], list(results.values()), out_dir))
        else:
            budget = None
            plots += report.plot(runs, out_dir, budget)
    summary["plots"] = plots
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    summary = asyncio.run(_bench(args))
    print(f"\nworkload {summary['workload']} (seed {summary['seed']}, {summary['num_requests']} requests)\n")
    print(report.table(summary["results"]))
    for key in ("continuous_over_static_throughput", "chunked_over_continuous"):
        if key in summary:
            print(f"\n{key}: {json.dumps(summary[key], indent=None)}")
    print(f"\nwrote {args.out}/results.json" + (f" and {len(summary['plots'])} plot(s)" if summary["plots"] else ""))


if __name__ == "__main__":
    main()
