"""engine-sim: what-if replay of a trace through the real scheduler on a virtual clock.

    engine-sim calibrate --steps bench-out/steps.jsonl --out calibration.json
    engine-sim calibrate --run --out calibration.json          # a short real run (needs torch)
    engine-sim run --calibration calibration.json --workload sharegpt-like --rate 4 --num-requests 2000
    engine-sim run --calibration c.json --trace trace.jsonl --set policy=continuous --set num_blocks=768
    engine-sim run --calibration c.json --workload spike-overlap --sweep max_step_ms=200,400,800
    engine-sim run --calibration c.json --workload sharegpt-like --rate 20 --duration-s 600 \\
        --replicas 8 --router prefix-affinity
    engine-sim run --calibration c.json --workload sharegpt-like --duration-s 600 \\
        --slo-ttft-ms 2000 --slo-itl-ms 500 --goodput --sweep replicas=1,2,4,8

`run` needs no torch, model or tokenizer. It prints engine-bench's table (plus the simulated /
wall-clock time ratio) and writes results.json and plots (when matplotlib is installed) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from engine.bench import report, workload
from engine.cli_args import number, positive_int
from engine.config import (DTYPES, PREFIX_ROUTER_KEYS, ClusterConfig, EngineConfig, ModelConfig, ServerConfig,
                           config_path, parse_sweep, parse_value)
from engine.sim import goodput, trace as traces
from engine.sim.calibration import Calibration, fit, load_steps
from engine.sim.simulator import ROUTERS, SimResult, simulate

SIM_KEYS = ("replicas", "router")  # swept like config keys, but they shape the cluster, not an engine
# Keys that set what a step costs, not what the scheduler does: `run` takes step times from the
# calibration, so overriding them there would change nothing (refused; calibrate with them instead).
CALIBRATED_KEYS = (*(f.name for f in dataclasses.fields(ModelConfig)), "kv_cache_dtype")
# Keys of what a simulation does not run: the HTTP server, and Ray's processes and probes (refused).
UNSIMULATED_KEYS = (*(f.name for f in dataclasses.fields(ServerConfig)), "ray_address", "ray_num_cpus", "replica_cpus",
                    "replica_gpus", "health_check_ms")
CLUSTER_KEYS = tuple(f.name for f in dataclasses.fields(ClusterConfig))
SIM_ROUTER = {v: k for k, v in ROUTERS.items()}  # [cluster] router's name -> --router's
MAX_PLOTTED_REQUESTS = 2000  # the per-request ITL plot draws a line per request
MAX_REQUESTS = 10_000_000  # a trace is built in memory before the run: more is a typo, not a plan
GOODPUT_START = 1.0  # req/s: the goodput search's first rate unless --goodput-start says otherwise
# The keys `calibrate --steps` records (or, weight_format, splits by) without --run; any other
# --set only shapes the real run, so without --run it would change nothing (refused).
RECORDED_KEYS = ("model", "dtype", "kv_cache_dtype", "weight_format")


_num_requests_arg = number(int, 1, high=MAX_REQUESTS)
_positive = number(float, 0, strict=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine-sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="simulate a trace or a workload")
    r.add_argument("--calibration", required=True, help="JSON from `engine-sim calibrate`")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--trace", help="trace JSONL (engine-bench --save-trace writes one)")
    src.add_argument("--workload", choices=sorted(workload.WORKLOADS), help="a bench workload (default sharegpt-like)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--num-requests", type=_num_requests_arg,
                   help="workload size (the bench's default 64 if neither this nor --duration-s)")
    r.add_argument("--rate", type=number(float, 0), help="arrivals per second; 0 = all at once (the default)")
    r.add_argument("--arrival", choices=traces.ARRIVALS, help="the arrival process (default poisson)")
    r.add_argument("--cv", type=_positive, help="--arrival gamma: coefficient of variation of the gaps (default 1)")
    r.add_argument("--duration-s", type=_positive, help="with --rate: as many requests as arrive in this long")
    r.add_argument("--config", help="the config file (default ./config.toml when there is one, else the built-in "
                                    "defaults)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine config override")
    r.add_argument("--step-noise", action=argparse.BooleanOptionalAction, default=True,
                   help="draw each step's forward time around its prediction from the calibration's "
                        "actual/predicted ratios (seeded by --seed); --no-step-noise: exactly the prediction")
    r.add_argument("--replicas", type=positive_int,
                   help="simulated engine replicas (default: the config's [cluster] replicas, where 0, engine-serve's "
                        "one engine in its own process, is 1)")
    r.add_argument("--router", choices=sorted(ROUTERS),
                   help="(default: the config's [cluster] router, where \"prefix\" is prefix-affinity)")
    r.add_argument("--sweep", metavar="KEY=V1,V2,...", help="one run per value of a config key, replicas or router")
    r.add_argument("--slo-ttft-ms", type=_positive)
    r.add_argument("--slo-itl-ms", type=_positive)
    r.add_argument("--goodput", action="store_true",
                   help=f"find the highest rate at which >= {goodput.TARGET * 100:.0f}%% of requests meet both SLOs (bisection)")
    r.add_argument("--goodput-start", type=_positive,
                   help=f"--goodput: the first rate the search tries (and, without --rate, the base run's rate; "
                        f"default {GOODPUT_START:g})")
    r.add_argument("--save-steps", metavar="PATH", help="write replica 0's StepRecords as JSONL (one run, not a sweep)")
    r.add_argument("--out", default="sim-out")
    r.add_argument("--no-plots", action="store_true")
    c = sub.add_parser("calibrate", help="fit a step-time calibration from a real run's steps")
    c.add_argument("--steps", action="append", default=[], metavar="PATH", help="StepRecord JSONL (engine-bench --save-steps)")
    c.add_argument("--run", action="store_true", help="make a short real run of --workload on the configured model (needs torch)")
    c.add_argument("--workload", choices=sorted(workload.WORKLOADS), help="--run: the workload (default mixed)")
    c.add_argument("--num-requests", type=_num_requests_arg, help="--run: the workload size")
    c.add_argument("--config", help="the config file (default ./config.toml when there is one, else the built-in "
                                    "defaults)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine config override (--run)")
    c.add_argument("--model", help="the model name to record; needed with --steps alone, as a steps file does not "
                                   "say which model ran it (--set model=NAME does too); --run: default the run's model")
    c.add_argument("--dtype", choices=DTYPES, help="the dtype to record (default: the config's)")
    c.add_argument("--max-model-len", type=positive_int, help="the model's context (--run: read from the model)")
    c.add_argument("--split-rows", type=number(int, 0),
                   help="fit steps of at most this many rows apart (default: where the GGUF kernel hands over to "
                        "the dense weights on this CPU: engine.cpu.NATIVE_MAX_ROWS, 8 on the AVX-512 path, 64 on "
                        "AVX2, 16 portable or under gguf-q8); 0 = one model")
    c.add_argument("--out", default="calibration.json")
    return p.parse_args(argv)


# --- config -----------------------------------------------------------------------------------

def _coerce(key: str, value: str):
    if key == "replicas":
        try:
            n = int(value)
        except ValueError:
            raise SystemExit(f"replicas: bad value {value!r}") from None
        if n < 1:
            raise SystemExit(f"replicas must be >= 1, got {n}")
        return n
    if key == "router":
        if value not in ROUTERS:
            raise SystemExit(f"router: {value!r} is not one of {sorted(ROUTERS)}")
        return value
    try:
        return parse_value(key, value)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _overrides(args) -> dict:
    """--set KEY=VALUE as config overrides, refusing the keys that would change nothing."""
    overrides = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set wants KEY=VALUE, got {item!r}")
        if args.command == "calibrate" and key in CLUSTER_KEYS:
            raise SystemExit(f"--set {key}: calibrate runs one engine in this process, so {key} would change nothing")
        if key in SIM_KEYS:
            raise SystemExit(f"--set {key}: use --{key}")
        _refuse_unsimulated("--set", key, args.command)
        overrides[key] = _coerce(key, value)
    return overrides


def _base_config(args, overrides: dict) -> EngineConfig:
    path = config_path(args.config)  # as given (a missing one is an error), else ./config.toml if there is one
    try:
        config = EngineConfig.load(path)
        if args.command == "run":
            # The simulated cluster: --replicas / --router, else the config's [cluster] keys, so that
            # results.json's config is what ran. Its replicas = 0 (engine-serve: one engine in its own
            # process) is one replica here.
            overrides["replicas"] = max(1, config.cluster.replicas) if args.replicas is None else args.replicas
            if args.router is not None:
                overrides["router"] = ROUTERS[args.router]
        return config.with_overrides(**overrides)
    except OSError as e:
        raise SystemExit(f"--config {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _refuse_unsimulated(flag: str, key: str, command: str) -> None:
    if key in UNSIMULATED_KEYS:
        raise SystemExit(f"{flag} {key}: the simulator runs no HTTP server and no Ray processes, "
                         f"so {key} would change nothing")
    if command == "run" and key in CALIBRATED_KEYS:
        raise SystemExit(f"{flag} {key}: the simulator takes step times from the calibration, which {key} "
                         f"does not change here; calibrate with it (engine-sim calibrate --run --set {key}=...)")


def _as_calibrated(config: EngineConfig, cal: Calibration, args) -> EngineConfig:
    """The config with the calibration's model, dtype and KV cache dtype where it records them, so
    that results.json's config is what was simulated. A config file's [model] keys are the server's
    too (the default ./config.toml names the served model), so they are overridden, not refused as
    --set refuses them; a config that asked for another is told so."""
    updates = {}
    if cal.model and cal.model != config.model.model:
        updates["model"] = cal.model
    if cal.dtype and cal.dtype != config.model.dtype:
        updates["dtype"] = cal.dtype
    dtype = updates.get("dtype", config.model.dtype)
    kv = cal.kv_cache_dtype or cal.dtype  # recorded since kv_cache_dtype could differ from the model's
    if kv and kv != config.cache.kv_dtype_for(dtype):
        updates["kv_cache_dtype"] = "auto" if kv == dtype else kv
    if not updates:
        return config
    asked = {"model": config.model.model, "dtype": config.model.dtype, "kv_cache_dtype": config.cache.kv_cache_dtype}
    source = config_path(args.config) or "the built-in defaults"
    print(f"{source}: {', '.join(f'{k} = {asked[k]}' for k in updates)} not simulated: step times are the "
          f"calibration's ({cal.model or '?'}, {cal.dtype or '?'}, KV {cal.kv_cache_dtype or '?'}), and results.json's "
          "config says so; calibrate with them to simulate them (engine-sim calibrate --run --set KEY=...)",
          file=sys.stderr)
    try:
        return config.with_overrides(**updates)
    except ValueError as e:
        raise SystemExit(f"--calibration {args.calibration}: {e}") from None


def _targets(args, base: EngineConfig) -> list[tuple[str, EngineConfig, int, str]]:
    """(name, config, replicas, router) per run: replicas and router are the config's [cluster] keys."""
    def target(name: str, config: EngineConfig):
        return name, config, config.cluster.replicas, SIM_ROUTER[config.cluster.router]

    if not args.sweep:
        return [target(base.scheduler.policy, base)]
    try:
        key, values = parse_sweep(args.sweep)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    _refuse_unsimulated("--sweep", key, args.command)
    out = []
    for raw in values:
        v = _coerce(key, raw)
        try:
            config = base.with_overrides(**{key: ROUTERS[v] if key == "router" else v})
        except ValueError as e:
            raise SystemExit(str(e)) from None
        out.append(target(f"{key}={raw}", config))
    return out


def _refuse_unrouted(args, targets) -> None:
    """A prefix-router key set or swept when no run routes by prefix would change nothing."""
    routers = sorted({router for *_, router in targets})
    if "prefix-affinity" in routers:
        return
    given = [("--set", item.partition("=")[0]) for item in args.set]
    if args.sweep:
        given.append(("--sweep", args.sweep.partition("=")[0]))
    for flag, key in given:
        if key in PREFIX_ROUTER_KEYS:
            raise SystemExit(f"{flag} {key}: only the prefix-affinity router reads it, and the router here is "
                             f"{' and '.join(routers)} (--router prefix-affinity, or [cluster] router = \"prefix\")")


# --- the trace ----------------------------------------------------------------------------------

def _num_requests(args, rate: float) -> int | None:
    if args.duration_s is None:
        return args.num_requests
    if rate <= 0:
        raise SystemExit("--duration-s needs a --rate > 0")
    expected = rate * args.duration_s
    if expected > MAX_REQUESTS:
        raise SystemExit(f"--rate x --duration-s: {rate:g}/s x {args.duration_s:g} s = {expected:.3g} requests, "
                         f"more than the {MAX_REQUESTS:,} one run may simulate")
    return max(1, math.ceil(expected))


def _base_rate(args) -> float:
    """--rate; under --goodput over a duration without one, the search's first rate."""
    rate = args.rate or 0.0
    return _goodput_start(args) if rate <= 0 and args.goodput and args.duration_s is not None else rate


def _goodput_start(args) -> float:
    return GOODPUT_START if args.goodput_start is None else args.goodput_start


def _check_trace_flags(args) -> None:
    """Refuse the flags that shape a generated workload where they would change nothing."""
    if args.trace:
        given = [flag for flag, v in (("--num-requests", args.num_requests), ("--rate", args.rate),
                                      ("--duration-s", args.duration_s), ("--arrival", args.arrival),
                                      ("--cv", args.cv)) if v is not None]
        if given:
            raise SystemExit(f"{given[0]}: --trace replays its file's requests at their own times, so "
                             f"{', '.join(given)} would change nothing")
    if args.num_requests is not None and args.duration_s is not None:
        raise SystemExit("--num-requests: --duration-s sets the number of requests (rate x duration); give one")
    if args.cv is not None and args.arrival != "gamma":
        raise SystemExit("--cv shapes gamma arrivals: add --arrival gamma (Poisson gaps have cv 1)")
    if args.arrival is not None and not args.trace and not args.rate and not args.goodput:
        raise SystemExit(f"--arrival {args.arrival}: without a --rate > 0 every request arrives at once (or, on the "
                         "spike workloads, when the spike says), so the arrival process would change nothing")


def _trace(args, vocab_size: int | None, rate: float | None = None) -> list[traces.TraceRequest]:
    """The run's trace; with `rate`, the same traffic at that rate (goodput probes)."""
    if args.trace:
        try:
            trace = traces.load(args.trace)
        except OSError as e:
            raise SystemExit(f"--trace {args.trace}: {e.strerror or e}") from None
        except ValueError as e:  # it names the file and the line
            raise SystemExit(f"--trace {e}") from None
        if rate is None:
            return trace
        span = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)
        if span <= 0:
            raise SystemExit("--goodput over a trace needs arrivals spread in time (its rate is scaled)")
        return traces.scale_rate(trace, rate / ((len(trace) - 1) / span))
    name = args.workload or "sharegpt-like"
    r = _base_rate(args) if rate is None else rate
    try:
        return traces.generate(name, args.seed, _num_requests(args, r), r, args.arrival or "poisson",
                               1.0 if args.cv is None else args.cv, vocab_size or workload.VOCAB_SIZE)
    except ValueError as e:
        raise SystemExit(str(e)) from None


# --- run ----------------------------------------------------------------------------------------

def _figures(res: SimResult, args, replicas: int, router: str) -> dict:
    out = report.result(res.timings, res.duration_s, None, args.slo_ttft_ms, args.slo_itl_ms)
    out.update(res.tally.figures())
    if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
        out["slo_met_fraction"] = goodput.fraction_meeting(res.timings, _s(args.slo_ttft_ms), _s(args.slo_itl_ms))
    out.update(replicas=replicas, router=router, routed=res.routed, sim_wall_s=res.wall_s,
               sim_speedup=res.speedup)
    return out


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _run(args) -> dict:
    if args.goodput and args.slo_ttft_ms is None and args.slo_itl_ms is None:
        raise SystemExit("--goodput needs --slo-ttft-ms and/or --slo-itl-ms")
    if args.goodput and args.workload in ("spike", "spike-overlap"):
        raise SystemExit(f"--goodput varies the arrival rate: workload {args.workload!r} sets its own arrivals")
    if args.goodput and not args.trace and args.duration_s is None:
        raise SystemExit("--goodput needs --duration-s: each rate probed runs that long (a fixed number of "
                         "requests becomes one burst at a high rate, which any cluster drains)")
    if args.save_steps and args.sweep:
        raise SystemExit("--save-steps writes one run's steps: not with --sweep")
    if args.goodput_start is not None and not args.goodput:
        raise SystemExit("--goodput-start: only the --goodput search reads it; add --goodput (and the SLOs)")
    _check_trace_flags(args)
    base = _base_config(args, _overrides(args))
    try:
        cal = Calibration.load(args.calibration)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--calibration: {e}") from None
    base = _as_calibrated(base, cal, args)
    targets = _targets(args, base)
    _refuse_unrouted(args, targets)
    if doubt := cal.doubt():
        print(f"{args.calibration}: {doubt}", file=sys.stderr)
    if args.step_noise and cal.forward_ratios is None:
        print(f"{args.calibration} has no step ratios (an older calibration): every step lasts its prediction, "
              "without step noise; `engine-sim calibrate` again to have them", file=sys.stderr)
    if cal.max_model_len is None:
        print(f"{args.calibration} has no max_model_len: no context limit is applied, so a request longer than "
              "the model's context runs instead of failing as intake would refuse it; `engine-sim calibrate "
              "--max-model-len N` to have one", file=sys.stderr)
    trace = _trace(args, cal.vocab_size)
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {args.out}: {e.strerror or e}") from None
    results, runs, found = {}, {}, {}
    keep = bool(args.save_steps) or (not args.no_plots and len(trace) <= MAX_PLOTTED_REQUESTS and not args.sweep)
    load_before = os.getloadavg()[0]
    for name, config, replicas, router in targets:
        res = simulate(trace, config, cal, replicas, router, keep_steps=keep, step_noise=args.step_noise, seed=args.seed)
        failed = [t for t in res.timings if not t.ok]
        if failed:
            print(f"{name}: {len(failed)} of {len(res.timings)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
        results[name] = _figures(res, args, replicas, router) | {"config": config.to_dict()}
        runs[name] = {"timings": res.timings, "steps": res.steps or [], "start": 0.0}
        print(f"{name}: {res.duration_s:.1f} s simulated in {res.wall_s:.2f} s wall ({res.speedup:.1f}x)", file=sys.stderr)
        if args.goodput:
            def probe(rate, config=config, replicas=replicas, router=router):
                r = simulate(_trace(args, cal.vocab_size, rate), config, cal, replicas, router, step_noise=args.step_noise,
                             seed=args.seed)
                return goodput.fraction_meeting(r.timings, _s(args.slo_ttft_ms), _s(args.slo_itl_ms))

            rate, probes = goodput.find(probe, _goodput_start(args))
            bounded = any(frac < goodput.TARGET for _, frac in probes)
            found[name] = {"rate": rate, "bounded": bounded, "probes": probes}
            results[name]["goodput_rate"] = rate
            print(f"{name}: goodput {'' if bounded else '>= '}{rate:.2f} req/s ({len(probes)} probes)", file=sys.stderr)
        if args.save_steps:
            _save_steps(res.steps or [], args.save_steps)
    summary = {
        "trace": args.trace or {"workload": args.workload or "sharegpt-like", "seed": args.seed, "rate": _base_rate(args),
                                "arrival": args.arrival or "poisson", "cv": 1.0 if args.cv is None else args.cv},
        "num_requests": len(trace), "seed": args.seed, "step_noise": args.step_noise, "results": results,
        "goodput": found, "versions": report.versions(),
        "calibration": {"path": args.calibration, "model": cal.model, "dtype": cal.dtype,
                        "kv_cache_dtype": cal.kv_cache_dtype or None, "max_model_len": cal.max_model_len,
                        "cpu": cal.cpu,
                        "source": cal.source, "forward_error_p50": cal.forward_error_p50},
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms, "target_fraction": goodput.TARGET},
        "load_avg_1m": {"start": load_before, "end": os.getloadavg()[0]},
    }
    summary["plots"] = [] if args.no_plots else _plots(args, targets, results, runs, found, out_dir)
    summary = report.strict_json(summary)
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    return summary


def _save_steps(steps, path: str) -> None:
    import msgspec

    enc = msgspec.json.Encoder()
    try:
        with open(path, "wb") as f:
            for s in steps:
                f.write(enc.encode(s) + b"\n")
    except OSError as e:
        raise SystemExit(f"--save-steps {path}: {e.strerror or e}") from None


def _plots(args, targets, results: dict, runs: dict, found: dict, out_dir: Path) -> list[str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    from engine.sim import plots

    if args.sweep:
        key, _, raw = args.sweep.partition("=")
        values = [_coerce(key, v) for v in raw.split(",")]
        paths = [report.plot_sweep(key, values, list(results.values()), out_dir, policy=targets[0][1].scheduler.policy)]
        if found:
            paths.append(plots.goodput(key, values, [found[n]["rate"] for n, *_ in targets], out_dir))
        return paths
    if sum(len(r["timings"]) for r in runs.values()) > MAX_PLOTTED_REQUESTS:
        print(f"more than {MAX_PLOTTED_REQUESTS} requests: per-request plots skipped", file=sys.stderr)
        return []
    return report.plot(runs, out_dir, None)


# --- calibrate ------------------------------------------------------------------------------------

def _calibrate(args) -> Calibration:
    from engine.cpu import cpu_info, kernel_isa, kernel_max_rows

    if not args.steps and not args.run:
        raise SystemExit("calibrate needs --steps PATH (engine-bench --save-steps) or --run")
    overrides = _overrides(args)
    if not args.run:  # flags that shape the real run change nothing without one
        given = [flag for flag, v in (("--workload", args.workload), ("--num-requests", args.num_requests))
                 if v is not None]
        given += [f"--set {key}" for key in overrides if key not in RECORDED_KEYS]
        if given:
            raise SystemExit(f"{given[0]}: only --run reads it (a run on the configured model); with --steps alone "
                             f"{', '.join(given)} would change nothing")
    # A steps file does not say which model ran it: the name recorded is the one given (or --run's
    # model), never the config's default passed off as the steps' model.
    model = args.model or overrides.get("model")
    if model is None and not args.run:
        raise SystemExit("--model: a steps file does not say which model ran it; name it with --model NAME "
                         "(or --set model=NAME), as engine-bench ran it")
    base = _base_config(args, overrides)
    records, max_len, vocab_size = [], args.max_model_len, None
    for path in args.steps:
        try:
            records += load_steps(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--steps {path}: {e}") from None
    if args.run:
        from engine.sim.calibration_run import calibration_run

        run_records, run_max_len, run_model, vocab_size = calibration_run(base, args.workload or "mixed", args.num_requests)
        records += run_records
        max_len = max_len or run_max_len
        model = model or run_model
    try:
        split = (kernel_max_rows(kernel_isa(), base.model.weight_format == "gguf-q8") if args.split_rows is None
                 else args.split_rows or None)
        dtype = args.dtype or base.model.dtype
        cal = fit(records, split_rows=split, model=model, dtype=dtype, kv_cache_dtype=base.cache.kv_dtype_for(dtype),
                  cpu=cpu_info().as_dict(), max_model_len=max_len, vocab_size=vocab_size, source=", ".join(args.steps + (["--run " + (args.workload or "mixed")] if args.run else [])))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        cal.save(args.out)
    except OSError as e:
        raise SystemExit(f"--out {args.out}: {e.strerror or e}") from None
    return cal


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "calibrate":
        cal = _calibrate(args)
        print(f"fitted {cal.num_steps} steps: forward R² {cal.forward_r2:.3f}, median error "
              f"{cal.forward_error_p50:.1%}; overhead {cal.overhead['fixed'] * 1000:.2f} ms + "
              f"{cal.overhead['sequence'] * 1000:.3f} ms/sequence"
              + (f"; steps of <= {cal.split_rows} rows fitted apart" if cal.split_rows else "")
              + f"; long steps {cal.sustained * 100:.2f} % slower per second predicted")
        print(f"model {cal.model} ({cal.dtype}, KV {cal.kv_cache_dtype}) on {cal.cpu.get('model')}; wrote {args.out}")
        if doubt := cal.doubt():
            print(f"warning: {doubt}", file=sys.stderr)
        if cal.max_model_len is None:
            print("warning: no --max-model-len: `engine-sim run` on this calibration applies no context limit "
                  "(requests longer than the model's context run instead of failing)", file=sys.stderr)
        return
    summary = _run(args)
    cal = summary["calibration"]
    print(f"\ntrace {json.dumps(summary['trace'])} ({summary['num_requests']} requests); calibration {cal['model']} "
          f"({cal['dtype']}) on {(cal['cpu'] or {}).get('model', '?')}\n")
    print(report.table(summary["results"]))
    for name, r in summary["results"].items():
        extra = f", goodput {r['goodput_rate']:.2f} req/s" if r.get("goodput_rate") is not None else ""
        print(f"{name}: simulated/wall {r['sim_speedup']:.1f}x ({r['sim_wall_s']:.2f} s wall){extra}")
    print(f"\nwrote {args.out}/results.json" + (f" and {len(summary['plots'])} plot(s)" if summary["plots"] else ""))


if __name__ == "__main__":
    main()
