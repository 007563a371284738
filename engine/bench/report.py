"""Turn one run's measurements into the result dict, the table and the plots."""

from __future__ import annotations

import math

from engine.bench.stats import RequestTiming, percentile, summarize
from engine.messages import StepRecord


def result(timings: list[RequestTiming], duration: float, steps: list[StepRecord] | None, slo_ttft_ms, slo_itl_ms) -> dict:
    out = summarize(timings, duration, _s(slo_ttft_ms), _s(slo_itl_ms))
    steady = [t for t in timings if t.tag == "steady" and t.ok]
    long = [t for t in timings if t.tag.startswith("long") and t.ok]
    if steady:
        gaps = [x for t in steady for x in t.itls]
        out["steady_itl_ms_p50"] = percentile(gaps, 50) * 1000
        out["steady_itl_ms_p99"] = percentile(gaps, 99) * 1000
        out["steady_itl_ms_max"] = max(gaps, default=float("nan")) * 1000
    if long:
        ttfts = [t.ttft for t in long if t.ttft is not None]
        out["long_ttft_ms_p50"] = percentile(ttfts, 50) * 1000
        out["long_ttft_ms_max"] = max(ttfts, default=float("nan")) * 1000
        for t in long:
            if t.tag != "long" and t.ttft is not None:  # spike-overlap: long-1, long-2
                out[f"{t.tag.replace('-', '')}_ttft_ms"] = t.ttft * 1000
    if steps is not None:
        padding = sum(s.num_padding_tokens for s in steps)
        total = sum(s.num_prefill_tokens + s.num_decode_tokens + s.num_padding_tokens for s in steps)
        cached = sum(s.num_cached_tokens for s in steps)
        prefilled = sum(s.num_prefill_tokens for s in steps)  # recomputation after preemption included
        out["num_steps"] = len(steps)
        out["padding_waste_pct"] = 100 * padding / total if total else 0.0
        out["preemptions"] = steps[-1].num_preemptions if steps else 0
        out["prefix_cache_hit_rate"] = cached / (cached + prefilled) if cached + prefilled else 0.0
        out["tokens_processed"] = total
        errors = [abs(s.predicted_s - s.forward_s) / s.forward_s for s in steps
                  if s.predicted_s is not None and s.forward_s > 0]
        if errors:  # the step-cost model: median |predicted - actual| / actual
            out["step_time_error_p50"] = percentile(errors, 50)
    return out


def request_records(timings: list[RequestTiming], start: float) -> list[dict]:
    """Each request's own timings (seconds; `sent_s` from the start of the run, the others
    from the request's send), enough to recompute every figure of its result."""
    return [{"tag": t.tag, "sent_s": t.arrival - start, "prompt_tokens": t.num_prompt_tokens,
             "output_tokens": t.num_output_tokens, "token_times_s": [x - t.arrival for x in t.token_times],
             "e2e_s": t.e2e, "error": t.error if not t.ok else None} for t in timings]


def versions() -> dict[str, str | None]:
    """The software a figure came from (None: not installed)."""
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("stepwise", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _s(ms):
    return None if ms is None else ms / 1000


COLUMNS = [
    ("output_tokens_per_s", "out tok/s", "{:.1f}"), ("requests_per_s", "req/s", "{:.2f}"),
    ("ttft_ms_p50", "TTFT p50", "{:.0f}"), ("ttft_ms_p99", "TTFT p99", "{:.0f}"),
    ("itl_ms_p50", "ITL p50", "{:.0f}"), ("itl_ms_p99", "ITL p99", "{:.0f}"), ("itl_ms_max", "ITL max", "{:.0f}"),
    ("tpot_ms_p50", "TPOT p50", "{:.0f}"),
    ("e2e_ms_p50", "E2E p50", "{:.0f}"), ("e2e_ms_p99", "E2E p99", "{:.0f}"), ("goodput_rps", "goodput", "{:.2f}"),
    ("padding_waste_pct", "pad %", "{:.1f}"), ("preemptions", "preempt", "{}"),
    ("prefix_cache_hit_rate", "prefix hit", "{:.2f}"), ("steady_itl_ms_p99", "steady ITL p99", "{:.0f}"),
    ("steady_itl_ms_max", "steady ITL max", "{:.0f}"), ("long_ttft_ms_max", "long TTFT", "{:.0f}"),
    ("long1_ttft_ms", "long-1 TTFT", "{:.0f}"), ("long2_ttft_ms", "long-2 TTFT", "{:.0f}"),
    ("step_time_error_p50", "step err p50", "{:.1%}"), ("limit_fraction", "of limit", "{:.0%}"),
]


def strict_json(obj):
    """NaN/inf (a percentile of nothing) -> None, so a results file is strict JSON (null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(v) for v in obj]
    return obj


def table(results: dict[str, dict]) -> str:
    cols = [c for c in COLUMNS if any(c[0] in r for r in results.values())]
    head = "| target | " + " | ".join(c[1] for c in cols) + " |"
    rule = "|---|" + "---:|" * len(cols)
    rows = []
    for name, r in results.items():
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            cells.append("–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])


def plot(runs: dict[str, dict], out_dir, budget: int | None) -> list[str]:
    """runs: name -> {"timings", "steps", "start", "spike_at"}. Returns written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    n = len(runs)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.6), sharey=True, squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items()):
        for t in run["timings"]:
            if t.tag in ("steady", "short", ""):
                xs = [x - run["start"] for x in t.token_times[1:]]
                ax.plot(xs, [g * 1000 for g in t.itls], lw=0.7, alpha=0.6)
        for t in run["timings"]:
            if t.tag == "long":
                ax.axvline(t.arrival - run["start"], color="red", ls="--", lw=1)
        ax.set_title(f"{name}: inter-token gaps")
        ax.set_xlabel("time since start (s)")
    axes[0][0].set_ylabel("gap (ms); red = long prompt arrives")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "itl_over_time.png"))

    stepped = {name: run for name, run in runs.items() if run["steps"]}  # peers and remote runs have none
    if stepped:
        paths.append(_plot_steps(plt, stepped, out_dir))

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, run in runs.items():
        ttfts = sorted(t.ttft for t in run["timings"] if t.ttft is not None)
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution (CDF)")
    ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))
    return paths


def _plot_steps(plt, runs: dict[str, dict], out_dir) -> str:
    """Stacked prefill / decode / padding tokens per step, one panel per run, budget line."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.4 * len(runs)), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        steps = run["steps"]
        xs = range(len(steps))
        pre = [s.num_prefill_tokens for s in steps]
        dec = [s.num_decode_tokens for s in steps]
        pad = [s.num_padding_tokens for s in steps]
        ax.bar(xs, pre, width=1.0, color="#4C72B0", label="prefill")
        ax.bar(xs, dec, width=1.0, bottom=pre, color="#55A868", label="decode")
        ax.bar(xs, pad, width=1.0, bottom=[a + b for a, b in zip(pre, dec)], color="#C44E52", label="padding")
        if steps and steps[0].token_budget:
            ax.axhline(steps[0].token_budget, color="black", ls="--", lw=1, label="budget")
        ax.set_yscale("symlog", linthresh=64)
        ax.set_title(f"{name}: tokens per step")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    return _save(fig, out_dir / "step_composition.png")


def plot_sweep(key: str, values: list, results: list[dict], out_dir, policy: str = "chunked") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(6, 3.6))
    itl = [r.get("steady_itl_ms_p99", r["itl_ms_p99"]) for r in results]
    ttft = [r.get("long_ttft_ms_max", r["ttft_ms_p99"]) for r in results]
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)
    xs = list(values) if numeric else list(range(len(values)))  # log2 axis for sizes, else categories
    ax1.plot(xs, itl, "o-", color="#4C72B0", label="ITL p99 (ms)")
    if numeric:
        ax1.set_xscale("log", base=2)
    else:
        ax1.set_xticks(xs, [str(v) for v in values])
    ax1.set_xlabel(key)
    ax1.set_ylabel("ITL p99 (ms)", color="#4C72B0")
    ax2 = ax1.twinx()
    ax2.plot(xs, ttft, "s--", color="#C44E52", label="long-prompt TTFT (ms)")
    ax2.set_ylabel("long-prompt TTFT (ms)", color="#C44E52")
    ax1.set_title(f"{policy}: latency trade-off vs {key}")
    fig.tight_layout()
    return _save(fig, out_dir / f"sweep_{key}.png")


def _save(fig, path) -> str:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
