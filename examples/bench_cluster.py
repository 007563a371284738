"""Prefix-aware routing against round-robin (and least-loaded) on engine replicas (Ray Serve).

    python examples/bench_cluster.py --num-requests 128 --rate 0.5 --num-blocks 320   # the README's run
    python examples/bench_cluster.py --routers prefix,round-robin,least-loaded --num-requests 256

One local Ray; for each router, fresh replicas (cold prefix caches) behind the ingress on a
free port, then the same seeded `shared-prefix` workload through engine-bench's remote runner
(Poisson arrivals, streamed). Prefix-cache hit rate = cached prompt tokens / prompt tokens,
summed over the replicas from the ingress's merged /metrics (before/after the run). Prints
one table and the ratios of the first router to the others, all from this one run, and the
machine's load average before and after.

The KV pool per replica (`--num-blocks`; 320 = 5,120 tokens) should hold about half of the
eight 1,000-token system prompts: a cluster whose replicas could each cache every prefix
would not need prefix-aware routing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import EngineConfig  # noqa: E402
from engine.cli_args import number, positive_int  # noqa: E402
from engine.bench import workload  # noqa: E402
from engine.bench.runner import run_remote  # noqa: E402
from engine.bench.stats import summarize  # noqa: E402
from engine.config import ROUTERS  # noqa: E402
from engine.model.loader import load_tokenizer  # noqa: E402
from frontends.cluster.app import create_cluster_app  # noqa: E402
from frontends.cluster.launch import Replicas  # noqa: E402
from frontends.cluster.serve import start_cluster  # noqa: E402
from frontends.http import HttpFrontend  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


async def scrape(url: str) -> tuple[float, float]:
    """(cached prompt tokens, computed + cached prompt tokens) summed over replicas."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    tokens = {"cached": 0.0, "prefill": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "stepwise:step_tokens_total" and s.labels.get("kind") in tokens:
                tokens[s.labels["kind"]] += s.value
    return tokens["cached"], tokens["cached"] + tokens["prefill"]


async def one_router(config: EngineConfig, requests) -> dict:
    replicas, engine = await start_cluster(config)
    frontend = HttpFrontend("127.0.0.1", 0, app_factory=create_cluster_app)
    await frontend.start(engine)
    try:
        cached0, prompt0 = await scrape(frontend.url)
        timings, duration = await run_remote(frontend.url, None, requests)
        cached1, prompt1 = await scrape(frontend.url)
        per_replica = dict(engine.router.load)  # all zero again: check nothing leaked
    finally:
        await frontend.stop()
        await engine.stop()
        await asyncio.to_thread(replicas.stop)
    summary = summarize(timings, duration)
    summary["hit_rate"] = (cached1 - cached0) / max(1.0, prompt1 - prompt0)
    summary["in_flight_after"] = per_replica
    errors = [t.error for t in timings if not t.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default="prefix,round-robin")
    p.add_argument("--replicas", type=positive_int, default=2)
    p.add_argument("--replica-cpus", type=number(float, 0, strict=True), default=1.0)
    p.add_argument("--num-requests", type=positive_int, default=128)
    p.add_argument("--rate", type=number(float, 0), default=0.5, help="Poisson arrivals per second (0 = all at once)")
    p.add_argument("--num-blocks", type=positive_int, default=320, help="KV pool per replica (16-token blocks)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    unknown = [r for r in args.routers.split(",") if r not in ROUTERS]
    if unknown:
        p.error(f"--routers: unknown {', '.join(map(repr, unknown))} (known: {', '.join(ROUTERS)})")

    print(f"load before: {os.getloadavg()}", flush=True)
    base = EngineConfig.load(None, model=args.model, replicas=args.replicas, replica_cpus=args.replica_cpus,
                             num_blocks=args.num_blocks, port=0)
    Replicas.connect(base)
    vocab_size = len(load_tokenizer(args.model, base.model.resolved_cache_dir()))
    requests = workload.make("shared-prefix", seed=args.seed, num_requests=args.num_requests, rate=args.rate,
                             vocab_size=vocab_size)
    results = {}
    try:
        for router in args.routers.split(","):
            results[router] = asyncio.run(one_router(base.with_overrides(router=router), requests))
            print(f"{router}: {results[router]}", flush=True)
    finally:
        ray.shutdown()
    print(f"load after: {os.getloadavg()}\n")
    print("| router | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | out tok/s | req/s | E2E p50 ms | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for router, s in results.items():
        print(f"| {router} | {s['hit_rate']:.1%} | {s['ttft_ms_p50']:.0f} | {s['ttft_ms_p99']:.0f} | "
              f"{s['output_tokens_per_s']:.1f} | {s['requests_per_s']:.2f} | {s['e2e_ms_p50']:.0f} | {s['num_failed']} |")
    first, *others = results
    for other in others:
        a, b = results[first], results[other]
        print(f"\n{first} vs {other}: TTFT p50 {b['ttft_ms_p50'] / a['ttft_ms_p50']:.2f}x lower, "
              f"hit rate {a['hit_rate'] / max(b['hit_rate'], 1e-9):.2f}x higher, "
              f"throughput {a['output_tokens_per_s'] / max(b['output_tokens_per_s'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
