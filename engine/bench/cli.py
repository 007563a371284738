"""engine-bench: reproduce the three stages with numbers and plots.

    engine-bench --workload mixed --policies static,continuous,chunked
    engine-bench --workload spike --policies continuous,chunked
    engine-bench --workload spike --policies chunked --sweep max_num_batched_tokens=64,128,256,512,1024
    engine-bench --workload mixed --url http://127.0.0.1:8000        # any OpenAI-compatible server
    engine-bench --workload mixed --policies continuous --peer transformers-static,transformers-cb
    engine-bench --workload single --policies chunked --peer llama.cpp --llama-server /path/to/llama-server

In-process mode runs each policy on a fresh engine (same config otherwise, model loaded
once), then each --peer: the same requests through transformers on the same model, or
through llama.cpp's llama-server on the same GGUF file (remote mode against a server the tool
starts; see engine/bench/llama_server.py). results.json records the CPU (model, features).
Results: a markdown table on stdout, results.json and PNG plots in --out.
Workloads, metrics and the results.json schema: docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import aiohttp
from tqdm import tqdm

from engine.bench import limit, llama_server, peers, report, workload
from engine.bench.runner import RemoteError, run_in_process, run_remote, served_model
from engine.cli_args import number, positive_int
from engine.config import EngineConfig, config_path, parse_sweep, parse_value
from engine.cpu import RESTRICT_ENV, cpu_info
from engine.engine import DTYPES, Engine
from engine.model.loader import load_model
from engine.torch_thread import in_passing_thread


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed", choices=sorted(workload.WORKLOADS))
    p.add_argument("--policies", help=f"comma-separated, in-process (default {DEFAULT_POLICIES})")
    p.add_argument("--url", help="benchmark a running OpenAI-compatible server instead")
    p.add_argument("--model", help="model name (remote) or model spec (in-process)")
    p.add_argument("--api-key", default="")
    p.add_argument("--config", help="in-process: TOML config (default ./config.toml if present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=positive_int, help="default: mixed and sharegpt-like 64, shared-prefix 256, single 1; "
                                                    "spike / spike-overlap: N - 2 streams + 2 long prompts (default 12 + 2)")
    p.add_argument("--rate", type=number(float, 0), help="Poisson arrivals per second; 0 (default) = all at once; "
                                              "not with spike / spike-overlap (they time their own arrivals)")
    p.add_argument("--vocab-size", type=number(int, 2),
                   help="prompt token ids are drawn below this (default: the tokenizer's size in-process, 20000 remote)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-itl-ms", type=float)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="in-process: engine config override")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help="run the first policy once per value")
    p.add_argument("--peer", metavar="NAME[,NAME]",
                   help=f"in-process: also run {' / '.join((*peers.PEERS, llama_server.NAME))}")
    p.add_argument("--llama-server", metavar="PATH", help="--peer llama.cpp: the llama-server binary to start")
    p.add_argument("--peer-batch-size", type=int, default=16, help="transformers-static: requests per generate call")
    p.add_argument("--compute-limit", action="store_true",
                   help="in-process: measure the prefill rate and report each target's fraction of the compute limit")
    p.add_argument("--save-trace", metavar="PATH",
                   help="write each run's trace (when each request was sent, token counts) as engine-sim JSONL")
    p.add_argument("--save-steps", metavar="PATH", help="in-process: write each run's StepRecords as JSONL (engine-sim calibrate)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


DEFAULT_POLICIES = "static,continuous,chunked"
SPIKES = ("spike", "spike-overlap")
# the model is loaded once for every run: a sweep of what the load depends on would label one
# model's figures with another's name
LOAD_KEYS = ("model", "dtype", "cache_dir")


def _check(args) -> None:
    """Flags that cannot mean anything, refused before a model loads or a request is sent."""
    if args.rate and args.workload in SPIKES:
        raise SystemExit(f"--rate: the {args.workload} workload times its own arrivals")
    if args.url:
        local = [flag for flag, given in (("--set", args.set), ("--config", args.config), ("--policies", args.policies),
                                          ("--sweep", args.sweep)) if given]
        if local:
            raise SystemExit(f"{', '.join(local)}: the server at --url runs its own config; in-process only")
    policies = _policies(args)
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        raise SystemExit(f"--policies: {', '.join(twice)} given more than once (a run is named by its policy)")
    swept = _sweep(args.sweep)[0] if args.sweep else None
    if swept in LOAD_KEYS:
        raise SystemExit(f"--sweep {swept}: the model is loaded once for every run; "
                         f"sweeping {'/'.join(LOAD_KEYS)} needs one engine-bench run per value")


def _policies(args) -> list[str]:
    return (args.policies or DEFAULT_POLICIES).split(",")


def _base_config(args) -> EngineConfig:
    try:
        base = EngineConfig.load(config_path(args.config), **_overrides(args.set))
        return base.with_overrides(model=args.model) if args.model else base
    except OSError as e:
        raise SystemExit(f"--config {args.config}: {e.strerror or e}") from None
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _per_target(path: str, name: str, num_targets: int) -> Path:
    """PATH itself for one target; PATH with the target's name before the suffix for several."""
    p = Path(path)
    if num_targets == 1:
        return p
    return p.with_name(f"{p.stem}.{name.replace(' ', '_').replace('=', '-')}{p.suffix}")


def _save_run(args, name: str, num_targets: int, requests, timings, start: float, steps) -> None:
    if args.save_trace:
        from engine.sim import trace

        # _paced keeps the requests' order; the first send is at the earliest offset, not at 0
        first = min(r.arrival_s for r in requests)
        sent = [t.arrival - start + first for t in timings]
        trace.save(trace.from_bench(requests, sent), _per_target(args.save_trace, name, num_targets))
    if args.save_steps and steps is not None:
        import msgspec

        enc = msgspec.json.Encoder()
        with open(_per_target(args.save_steps, name, num_targets), "wb") as f:
            for s in steps:
                f.write(enc.encode(s) + b"\n")


def _coerce(key: str, value: str):
    try:
        return parse_value(key, value)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _sweep(spec: str) -> tuple[str, list[str]]:
    try:
        return parse_sweep(spec)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _ratio(a, b) -> float | None:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b


def _peers(args) -> list[str]:
    """The --peer names, checked before the model loads."""
    if not args.peer:
        return []
    if args.url or args.sweep:
        raise SystemExit("--peer runs transformers on the loaded model: in-process only, not with --url or --sweep")
    try:
        names = peers.parse(args.peer, known=(*peers.PEERS, llama_server.NAME))
        peers.PeerSettings(batch_size=args.peer_batch_size)
        if llama_server.NAME in names:
            llama_server.resolve_binary(args.llama_server)
        return names
    except ValueError as e:
        raise SystemExit(f"--peer: {e}") from None


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set wants KEY=VALUE, got {item!r}")
        out[key] = _coerce(key, value)
    return out


async def _bench(args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, runs = {}, {}
    _check(args)
    vocab_size = args.vocab_size or workload.VOCAB_SIZE
    peer_names = _peers(args)
    if args.save_steps and (args.url or peer_names):
        raise SystemExit("--save-steps records the engine's steps: in-process only, without --url or --peer")
    if args.url and args.compute_limit:
        raise SystemExit("--compute-limit measures the loaded model: in-process only, not with --url")
    if args.url:
        targets = [(args.url, {})]
    else:
        sweep = _sweep(args.sweep) if args.sweep else None  # checked before the model loads
        base = _base_config(args)
        policies = _policies(args)
        try:  # a misspelt policy fails here, not after the model has loaded
            for policy in policies:
                base.with_overrides(policy=policy)
        except ValueError as e:
            raise SystemExit(f"--policies: {e}") from None
        for value in sweep[1] if sweep else ():  # ... and so does a sweep's bad value, not after the first runs
            try:
                base.with_overrides(policy=policies[0], **{sweep[0]: _coerce(sweep[0], value)})
            except ValueError as e:
                raise SystemExit(f"--sweep {sweep[0]}={value}: {e}") from None
        # loaded on a thread that then exits, as the peers run: only each engine's own thread keeps
        # torch's OpenMP pool alive while it runs (engine/torch_thread.py)
        loaded = await in_passing_thread(load_model, base.model.model, base.model.resolved_cache_dir(),
                                         DTYPES[base.model.dtype])
        if llama_server.NAME in peer_names and loaded.gguf is None:
            raise SystemExit(f"--peer llama.cpp runs the model's GGUF file: {base.model.model!r} is not a GGUF model")
        vocab_size = args.vocab_size or len(loaded.tokenizer)
        if sweep:
            key, values = sweep
            targets = [(f"{policies[0]} {key}={v}", {"policy": policies[0], key: _coerce(key, v)}) for v in values]
        else:
            targets = [(p, {"policy": p}) for p in policies]
        settings = peers.PeerSettings.from_engine(base, args.peer_batch_size)
        targets += [(name, None) for name in peer_names]  # None: a transformers peer, not an engine config
    requests = workload.make(args.workload, args.seed, args.num_requests, args.rate or 0.0, vocab_size)
    load_before = os.getloadavg()[0]
    for name, overrides in targets:
        bar = tqdm(total=len(requests), desc=name, unit="req", file=sys.stderr)
        if args.url:
            try:
                model = args.model or await served_model(args.url, args.api_key)
                timings, duration = await run_remote(args.url, model, requests, args.api_key, lambda: bar.update())
            except (RemoteError, aiohttp.ClientError, OSError) as e:
                raise SystemExit(f"--url {args.url}: {e}") from None
            steps, ran = None, {"model": model}
        elif name == llama_server.NAME:
            threads = base.model.num_threads or _torch_threads()
            binary = llama_server.resolve_binary(args.llama_server)
            with llama_server.llama_server(binary, loaded.gguf, threads, requests, base.scheduler.max_num_seqs,
                                           out_dir / "llama-server.log") as url:
                timings, duration = await run_remote(url, None, requests, "", lambda: bar.update())
            steps = None
            ran = {"llama_server": {"binary": binary, **llama_server.settings(threads, requests, base.scheduler.max_num_seqs)}}
        elif overrides is None:
            run = await in_passing_thread(peers.run, name, loaded, requests, settings, lambda: bar.update())
            timings, duration, steps, ran = run.timings, run.duration, None, {"peer": dataclasses.asdict(settings)}
        else:
            config = base.with_overrides(**overrides)
            async with Engine(config, loaded=loaded) as engine:
                timings, duration, steps = await run_in_process(engine, requests, lambda: bar.update())
            ran = {"config": config.to_dict()}
        start = min(t.arrival for t in timings)
        bar.close()
        failed = [t for t in timings if not t.ok]
        if failed:
            print(f"{name}: {len(failed)} of {len(timings)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
        results[name] = report.result(timings, duration, steps, args.slo_ttft_ms, args.slo_itl_ms)
        results[name].update(ran, requests=report.request_records(timings, start))
        runs[name] = {"timings": timings, "steps": steps, "start": start}
        _save_run(args, name, len(targets), requests, timings, start, steps)
    summary = {"workload": args.workload, "seed": args.seed, "num_requests": len(requests), "rate": args.rate or 0.0,
               "vocab_size": vocab_size, "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
               "results": results,
               # the machine running engine-bench (in-process: the engine's and the peers' CPU)
               "cpu": cpu_info().as_dict(), "versions": report.versions(),
               "load_avg_1m": {"start": load_before, "end": os.getloadavg()[0]}}
    if not args.url:
        summary.update(_ratios(results, peer_names))
        if args.compute_limit:
            summary["compute_limit"] = await _compute_limit(base, loaded, vocab_size, requests, results)
    plots = []
    if not args.no_plots:
        if args.sweep:
            key, values = _sweep(args.sweep)
            plots.append(report.plot_sweep(key, [_coerce(key, v) for v in values], list(results.values()), out_dir,
                                           policy=_policies(args)[0]))
        else:
            budget = None
            plots += report.plot(runs, out_dir, budget)
    summary["plots"] = plots
    summary = report.strict_json(summary)
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    return summary


def _ratios(results: dict[str, dict], peer_names: list[str]) -> dict:
    out, names = {}, set(results)
    if {"static", "continuous"} <= names and results["static"]["output_tokens_per_s"]:
        out["continuous_over_static_throughput"] = _ratio(
            results["continuous"]["output_tokens_per_s"], results["static"]["output_tokens_per_s"])
    if {"continuous", "chunked"} <= names and "steady_itl_ms_max" in results["chunked"]:
        c, k = results["continuous"], results["chunked"]
        out["chunked_over_continuous"] = {
            "steady_itl_max": _ratio(k.get("steady_itl_ms_max"), c.get("steady_itl_ms_max")),
            "steady_itl_p99": _ratio(k.get("steady_itl_ms_p99"), c.get("steady_itl_ms_p99")),
            "long_ttft": _ratio(k.get("long_ttft_ms_max"), c.get("long_ttft_ms_max")),
            "output_tok_s": _ratio(k.get("output_tokens_per_s"), c.get("output_tokens_per_s")),
        }
        for key in ("long1_ttft_ms", "long2_ttft_ms"):  # spike-overlap
            if key in k:
                out["chunked_over_continuous"][key.removesuffix("_ms")] = _ratio(k.get(key), c.get(key))
    if peer_names:  # output tokens/s of each engine target over each peer's
        out["throughput_over_peers"] = {
            name: {p: _ratio(r["output_tokens_per_s"], results[p]["output_tokens_per_s"]) for p in peer_names}
            for name, r in results.items() if name not in peer_names
        }
        # decode speed (1 / median time per output token after the first) over each peer's
        out["decode_speed_over_peers"] = {
            name: {p: _ratio(results[p].get("tpot_ms_p50"), r.get("tpot_ms_p50")) for p in peer_names}
            for name, r in results.items() if name not in peer_names
        }
    return out


async def _compute_limit(config, loaded, vocab_size: int, requests, results: dict[str, dict]) -> dict:
    """Measure both prefill rates; add each target's fraction of the limit to its result."""
    rates = {"transformers": await in_passing_thread(limit.transformers_prefill_rate, loaded, vocab_size),
             "engine": await limit.engine_prefill_rate(config, loaded, vocab_size)}
    limits = {k: limit.output_limit(v, requests) for k, v in rates.items()}
    for r in results.values():
        r["limit_fraction"] = _ratio(r["output_tokens_per_s"], limits["transformers"])
        r["limit_fraction_engine_rate"] = _ratio(r["output_tokens_per_s"], limits["engine"])
    return {"prompt_len": limit.PROMPT_LEN, "prefill_tokens_per_s": rates, "output_tokens_per_s_limit": limits}


def main(argv=None) -> None:
    args = parse_args(argv)
    summary = asyncio.run(_bench(args))
    print(f"\nworkload {summary['workload']} (seed {summary['seed']}, {summary['num_requests']} requests)")
    cpu = summary["cpu"]
    restricted = (f", restricted by {RESTRICT_ENV} from {', '.join(cpu['restricted_from'])}"
                  if "restricted_from" in cpu else "")
    print(f"cpu: {cpu['model']} ({', '.join(cpu['features']) or 'no SIMD features listed'}; "
          f"{cpu['num_logical_cores']} cores{restricted}); load 1m {summary['load_avg_1m']['start']:.2f} -> "
          f"{summary['load_avg_1m']['end']:.2f}\n")
    print(report.table(summary["results"]))
    for key in ("continuous_over_static_throughput", "chunked_over_continuous", "throughput_over_peers",
                "decode_speed_over_peers", "compute_limit"):
        if key in summary:
            print(f"\n{key}: {json.dumps(summary[key], indent=None)}")
    print(f"\nwrote {args.out}/results.json" + (f" and {len(summary['plots'])} plot(s)" if summary["plots"] else ""))
    dead = [name for name, r in summary["results"].items() if r["num_failed"] and r["num_failed"] == r["num_requests"]]
    if dead:  # its figures are zeros, not a measurement
        raise SystemExit(f"every request of {', '.join(dead)} failed (see above)")


if __name__ == "__main__":
    main()
