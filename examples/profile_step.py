"""Where a decode step's time goes with 64 requests running (real model, default config).

    .venv/bin/python examples/profile_step.py [--running 64] [--steps 30] [--cprofile]

Submits `--running` requests (32-token prompts, ignore_eos, long enough to outlast the
measurement), waits until all of them are decoding, then takes `--steps` consecutive
decode-only steps and splits each step's cycle (from one step's start to the next's) into:
- forward: the model forward alone (StepRecord.forward_s);
- executor Python: the rest of the executor's step, building the flat batch and sampling
  (duration_s - forward_s);
- scheduler + loop: everything between two executor steps, on the event loop: planning,
  block manager messages, updating requests, detokenizing, handing out outputs, publishing
  the record (cycle - duration_s).
Overhead = 1 - forward / cycle. Also counts the scheduler's messages to the KV block manager
per measured step (the design sends exactly one). `--cprofile` adds the event loop thread's hottest functions
over the measured window. Also prints the process's peak RSS (VmHWM). Not a test: numbers
vary with the machine and with whatever else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
from pathlib import Path

from engine import Engine, EngineConfig, SamplingParams
from engine.cli_args import positive_int
from engine.messages import StepRecord

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main(running: int, steps: int, profile: bool) -> None:
    config = EngineConfig.load(ROOT / "config.toml", max_num_seqs=running)
    async with Engine(config) as engine:
        records: list[StepRecord] = []
        measuring = asyncio.Event()
        done = asyncio.Event()
        profiler = cProfile.Profile()

        async def watch() -> None:
            async for r in engine.steps():
                decode_only = r.num_running == running and r.num_decode_tokens == running and not r.num_prefill_tokens
                if not measuring.is_set() and decode_only:
                    measuring.set()
                    if profile:
                        profiler.enable()
                elif measuring.is_set():
                    records.append(r)
                    if len(records) > steps:
                        if profile:
                            profiler.disable()
                        done.set()
                        return

        kv_messages: list[int] = []  # block manager messages handled, read at each measured record

        async def count_messages() -> None:
            await measuring.wait()
            start = engine.block_manager.num_messages
            await done.wait()
            kv_messages.append(engine.block_manager.num_messages - start)

        counter = asyncio.create_task(count_messages())
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        params = SamplingParams(max_tokens=steps + 200, temperature=0.0, ignore_eos=True)
        prompts = [[100 + (7 * i + j) % 5000 for j in range(32)] for i in range(running)]

        async def consume(prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, params):
                if done.is_set():
                    return  # breaking out aborts the request

        consumers = [asyncio.create_task(consume(p)) for p in prompts]
        await done.wait()
        await asyncio.gather(*consumers, watcher, counter)

    cycles = [b.start_time - a.start_time for a, b in zip(records, records[1:])]
    rows = records[:-1]
    forward = [r.forward_s for r in rows]
    executor_py = [r.duration_s - r.forward_s for r in rows]
    outside = [c - r.duration_s for c, r in zip(cycles, rows)]
    mean_cycle = statistics.mean(cycles)
    print(f"{len(rows)} decode-only steps with {running} running\n")
    print("| part | mean ms | share of cycle |")
    print("|---|---:|---:|")
    for name, values in (("forward", forward), ("executor Python (batch, sampling)", executor_py),
                         ("scheduler + event loop", outside), ("cycle", cycles)):
        print(f"| {name} | {statistics.mean(values) * 1e3:.1f} | {statistics.mean(values) / mean_cycle:.1%} |")
    print(f"\noverhead (1 - forward / cycle): {1 - sum(forward) / sum(cycles):.1%}")
    # steps after the first measuring record, up to the one that set `done`: len(records) steps
    print(f"KV block manager messages per step: {kv_messages[0] / len(records):.2f} "
          f"({kv_messages[0]} messages over {len(records)} steps)")
    print(f"peak RSS (VmHWM): {peak_rss_mib():.0f} MiB")
    if profile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print("\nevent loop thread, by own time:\n" + out.getvalue())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=30)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    asyncio.run(main(args.running, args.steps, args.cprofile))
