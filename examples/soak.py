"""Soak test: many streaming requests over HTTP while clients disconnect at random points;
nothing may be lost and nothing may leak.

    python examples/soak.py                          # 1000 requests, in-process server, tiny model
    python examples/soak.py --model smollm2-135m --requests 300 --prompts 16
    python examples/soak.py --url http://127.0.0.1:8000 --api-key sk-...   # a running engine-serve

Every request is greedy (temperature 0, ignore_eos) and streamed (completions and chat). A
share of the clients (--disconnect-share, default 0.3) leave: half of them before the first
token (the POST is cancelled before the response headers, which go out with the first
token), half mid-stream (after reading a random number of chunks). Each surviving request
must end with finish_reason "length" and exactly the text of a reference computed first by a
non-streaming request with the same prompt.

Afterwards the server must be idle: running = waiting = 0 and KV usage = 0 (the /metrics
gauges). With an in-process server also the internals: no request left in the scheduler or in
the engine's live streams, the block pool's invariants hold with every block free, the HTTP
frontend's registry of live handlers is empty, and the number of asyncio tasks is back to its
baseline. Prints a summary; exits 1 if any request was wrong or anything leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.cli_args import positive_int  # noqa: E402
from frontends.http import sse  # noqa: E402

PREAMBLE = "You are a careful assistant. Answer briefly and stay on topic. "
WORDS = ("river stone lamp orbit velvet signal harbor maple quartz lantern echo meadow copper falcon ember "
         "tide glacier prism cedar comet").split()
TIMEOUT_S = 120.0  # per request: a request that takes longer is reported as hung


@dataclass(frozen=True)
class Options:
    requests: int = 1000
    concurrency: int = 64
    disconnect_share: float = 0.3
    prompts: int = 32  # distinct prompts (each with its own endpoint and max_tokens)
    min_tokens: int = 8
    max_tokens: int = 48
    seed: int = 0
    api_key: str = ""
    model: str | None = None  # the "model" field sent; None = leave it out


@dataclass(frozen=True)
class Prompt:
    endpoint: str  # "/v1/completions" | "/v1/chat/completions"
    body: dict  # without "stream"

    def streaming(self, include_usage: bool) -> dict:
        return {**self.body, "stream": True, "stream_options": {"include_usage": include_usage}}


@dataclass(frozen=True)
class Job:
    index: int
    prompt: int
    behaviour: str  # "complete" | "early" (leave before the first token) | "mid" (leave mid-stream)
    quit_after: float  # early: seconds before leaving; mid: chunks read before leaving


@dataclass
class Report:
    requests: int = 0
    planned_disconnects: int = 0
    completed: int = 0
    correct: int = 0
    disconnects: Counter = field(default_factory=Counter)  # "before_first_token" / "mid_stream"
    failures: list[str] = field(default_factory=list)  # wrong text, errors, hangs
    leaks: list[str] = field(default_factory=list)
    checks: dict[str, object] = field(default_factory=dict)  # what was measured afterwards
    elapsed_s: float = 0.0

    @property
    def num_disconnects(self) -> int:
        return sum(self.disconnects.values())

    @property
    def ok(self) -> bool:
        return not self.failures and not self.leaks and self.correct == self.completed == self.requests - self.num_disconnects

    def summary(self) -> str:
        lines = [
            f"soak: {self.requests} streaming requests in {self.elapsed_s:.1f} s",
            f"  completed {self.completed}, correct {self.correct}; disconnects {self.num_disconnects} "
            f"({self.disconnects['before_first_token']} before the first token, {self.disconnects['mid_stream']} mid-stream; "
            f"{self.planned_disconnects} planned, the rest reached the end first and were checked)",
            "  afterwards: " + ", ".join(f"{k} {v}" for k, v in self.checks.items()),
            f"  failures: {len(self.failures)}; leaks found: {len(self.leaks)}",
        ]
        lines += [f"    failure: {f}" for f in self.failures[:20]]
        lines += [f"    leak: {leak}" for leak in self.leaks]
        return "\n".join(lines)


# --- the workload ---------------------------------------------------------------------------------


def make_prompts(options: Options) -> list[Prompt]:
    rng = random.Random(options.seed)
    prompts = []
    for i in range(options.prompts):
        text = f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
        shared = rng.random() < 0.5  # half share a preamble: the prefix cache gets exercised too
        max_tokens = rng.randint(options.min_tokens, options.max_tokens)
        common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if options.model:
            common["model"] = options.model
        if i % 3 == 2:
            messages = ([{"role": "system", "content": PREAMBLE}] if shared else []) + [{"role": "user", "content": text}]
            prompts.append(Prompt("/v1/chat/completions", {"messages": messages, **common}))
        else:
            prompts.append(Prompt("/v1/completions", {"prompt": (PREAMBLE if shared else "") + text, **common}))
    return prompts


def make_jobs(options: Options, prompts: list[Prompt]) -> list[Job]:
    rng = random.Random(options.seed + 1)
    n_leave = round(options.requests * options.disconnect_share)
    behaviours = ["early"] * (n_leave // 2) + ["mid"] * (n_leave - n_leave // 2)
    behaviours += ["complete"] * (options.requests - n_leave)
    rng.shuffle(behaviours)
    jobs = []
    for i, behaviour in enumerate(behaviours):
        p = rng.randrange(len(prompts))
        if behaviour == "early":
            quit_after = rng.uniform(0, 0.03)
        elif behaviour == "mid":
            # chunks, not tokens: a multi-byte character or a lagging reader (coalesced deltas) makes
            # fewer chunks than tokens, so stay in the first quarter to leave before the end
            quit_after = rng.randint(1, max(1, prompts[p].body["max_tokens"] // 4))
        else:
            quit_after = 0
        jobs.append(Job(i, p, behaviour, quit_after))
    return jobs


def chunk_text(event: dict) -> str:
    if not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""




# --- one client -----------------------------------------------------------------------------------


async def run_job(session: aiohttp.ClientSession, url: str, job: Job, prompt: Prompt, reference: str,
                  report: Report) -> None:
    include_usage = job.index % 2 == 0
    body = prompt.streaming(include_usage)
    where = f"request {job.index} ({job.behaviour}, prompt {job.prompt})"
    post = asyncio.ensure_future(session.post(url + prompt.endpoint, json=body))
    if job.behaviour == "early":
        done, _ = await asyncio.wait([post], timeout=job.quit_after)
        if not done:
            post.cancel()  # the connection is dropped before any response byte arrived
            await asyncio.wait([post])
            if post.cancelled():
                report.disconnects["before_first_token"] += 1
                return
        resp = post.result()  # headers came first (they go out with the first token)
        resp.close()
        report.disconnects["mid_stream"] += 1
        return
    resp = await post
    try:
        if resp.status != 200:
            report.failures.append(f"{where}: HTTP {resp.status}: {(await resp.text())[:300]}")
            return
        text, finish, usage, events = "", None, None, 0
        async for data in sse.events(resp.content, sse.EventParser(strict=True)):
            event = sse.decode(data)
            if event == "[DONE]":
                break
            if "error" in event:
                report.failures.append(f"{where}: error event {event}")
                return
            events += 1
            text += chunk_text(event)
            if event.get("choices") and event["choices"][0].get("finish_reason"):
                finish = event["choices"][0]["finish_reason"]
            if event.get("usage"):
                usage = event["usage"]
            if job.behaviour == "mid" and events >= job.quit_after:
                resp.close()  # leave mid-stream
                report.disconnects["mid_stream"] += 1
                return
        else:
            report.failures.append(f"{where}: the stream ended without [DONE]")
            return
        report.completed += 1
        max_tokens = prompt.body["max_tokens"]
        problems = []
        if text != reference:
            problems.append(f"text {text!r} != reference {reference!r}")
        if finish != "length":
            problems.append(f"finish_reason {finish!r}")
        if include_usage and (usage is None or usage["completion_tokens"] != max_tokens):
            problems.append(f"usage {usage}")
        if problems:
            report.failures.append(f"{where}: " + "; ".join(problems))
        else:
            report.correct += 1
    finally:
        resp.close()


async def references(session: aiohttp.ClientSession, url: str, prompts: list[Prompt]) -> list[str]:
    """Each prompt's text from a non-streaming request, one at a time."""
    out = []
    for p in prompts:
        async with session.post(url + p.endpoint, json=p.body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"reference request failed: HTTP {resp.status}: {data}")
            choice = data["choices"][0]
            out.append(choice["text"] if "text" in choice else choice["message"]["content"])
    return out


# --- afterwards -----------------------------------------------------------------------------------


def _gauges(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        aborts = line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
        if aborts or line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    return values


async def check_idle(session: aiohttp.ClientSession, url: str, report: Report, timeout: float) -> None:
    """The /metrics gauges reach zero (bounded wait)."""
    gauges: dict[str, float] = {}
    try:
        async with asyncio.timeout(timeout):
            while True:
                async with session.get(url + "/metrics") as resp:
                    gauges = _gauges(await resp.text())
                if gauges and not any(v for k, v in gauges.items() if not k.startswith("vllm:request_success")):
                    break
                await asyncio.sleep(0.02)
    except TimeoutError:
        report.leaks.append(f"/metrics gauges not zero after {timeout} s: {gauges}")
    report.checks["running"] = gauges.get("vllm:num_requests_running")
    report.checks["waiting"] = gauges.get("vllm:num_requests_waiting")
    report.checks["kv usage"] = gauges.get("vllm:kv_cache_usage_perc")
    # informational: aborts are counted when the next step is published, so idle-time ones may lag
    report.checks["aborts seen by the engine"] = int(gauges.get("vllm:request_success_total", 0))


async def check_internals(engine, frontend, baseline_tasks: set[asyncio.Task], report: Report, timeout: float) -> None:
    """In-process server: queues, live streams, blocks, handler registry and asyncio tasks."""
    from frontends.http.state import STATE

    live = frontend.runner.app[STATE].live

    def leftovers() -> dict[str, int]:
        snap = engine.snapshot()
        extra = [t for t in asyncio.all_tasks() if t not in baseline_tasks and t is not asyncio.current_task()]
        return {
            "scheduler requests": len(engine.scheduler.requests), "running (snapshot)": len(snap.running),
            "waiting (snapshot)": len(snap.waiting), "engine live streams": len(engine._live),
            "blocks in use": engine.block_manager.figures.num_blocks - engine.block_manager.figures.num_free_blocks,
            "block owners": engine.block_manager.figures.num_owners, "live handlers": len(live),
            "extra asyncio tasks": len(extra),
        }

    found = leftovers()
    try:
        async with asyncio.timeout(timeout):
            while any(found.values()):
                await asyncio.sleep(0.02)
                found = leftovers()
    except TimeoutError:
        for what, n in found.items():
            if n:
                report.leaks.append(f"{what}: {n}")
        extra = [t.get_name() for t in asyncio.all_tasks() if t not in baseline_tasks and t is not asyncio.current_task()]
        if extra:
            report.leaks.append(f"tasks: {sorted(extra)[:20]}")
    try:
        engine.block_manager.check_invariants()
    except AssertionError as e:
        report.leaks.append(f"block pool invariants: {e}")
    report.checks.update(found)
    report.checks["asyncio tasks"] = f"{len(asyncio.all_tasks()) - 1} (baseline {len(baseline_tasks) - 1})"


# --- the run --------------------------------------------------------------------------------------


async def soak(url: str, options: Options, *, engine=None, frontend=None, log=print, idle_timeout: float = 15) -> Report:
    """Run the soak against `url`; with `engine` and `frontend` (in-process) check internals too."""
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    prompts = make_prompts(options)
    jobs = make_jobs(options, prompts)
    async with aiohttp.ClientSession(headers=headers) as session:
        started = time.perf_counter()
        refs = await references(session, url, prompts)
        log(f"references: {len(prompts)} prompts in {time.perf_counter() - started:.1f} s")
    baseline = set(asyncio.all_tasks())
    if engine is not None:  # the reference session's connections are closing: let the server's tasks end
        try:
            async with asyncio.timeout(5):
                while len(frontend.runner.server.connections):
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pass
        baseline = set(asyncio.all_tasks())
    report = Report(requests=options.requests, planned_disconnects=sum(j.behaviour != "complete" for j in jobs))
    gate = asyncio.Semaphore(options.concurrency)
    connector = aiohttp.TCPConnector(limit=options.concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:

        async def one(job: Job) -> None:
            async with gate:
                try:
                    async with asyncio.timeout(TIMEOUT_S):
                        await run_job(session, url, job, prompts[job.prompt], refs[job.prompt], report)
                except TimeoutError:
                    report.failures.append(f"request {job.index} ({job.behaviour}): no answer in {TIMEOUT_S} s (hung)")
                except Exception as e:
                    report.failures.append(f"request {job.index} ({job.behaviour}): {type(e).__name__}: {e}")
                done = report.completed + report.num_disconnects + len(report.failures)
                if done % max(1, options.requests // 10) == 0:
                    log(f"  {done}/{options.requests} ({report.num_disconnects} disconnects)")

        started = time.perf_counter()
        await asyncio.gather(*(one(job) for job in jobs))
        report.elapsed_s = time.perf_counter() - started
        await check_idle(session, url, report, idle_timeout)
    if engine is not None:
        await check_internals(engine, frontend, baseline, report, idle_timeout)
    return report


async def soak_in_process(options: Options, config, loaded=None, log=print) -> Report:
    """Start an engine and an HTTP server on 127.0.0.1 (a free port), soak it, stop it."""
    from engine import Engine
    from frontends.http import HttpFrontend

    engine = Engine(config, loaded=loaded)
    await engine.start()
    frontend = HttpFrontend(port=0)
    await frontend.start(engine)
    try:
        log(f"in-process server on {frontend.url} ({config.model.model}, policy {config.scheduler.policy})")
        return await soak(frontend.url, options, engine=engine, frontend=frontend, log=log)
    finally:
        await frontend.stop()
        await engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=1000)
    parser.add_argument("--concurrency", type=positive_int, default=64)
    parser.add_argument("--disconnect-share", type=float, default=0.3)
    parser.add_argument("--prompts", type=positive_int, default=32,
                        help="distinct prompts (references computed for each)")
    parser.add_argument("--max-tokens", type=positive_int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server (default: start one in-process)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--model", default="tiny-random", help="in-process model: tiny-random or smollm2-135m")
    parser.add_argument("--config", default=None, help="TOML config for the in-process server (default: built-in)")
    args = parser.parse_args(argv)
    if not 0 <= args.disconnect_share <= 1:
        parser.error("--disconnect-share must be in [0, 1]")
    options = Options(requests=args.requests, concurrency=args.concurrency, disconnect_share=args.disconnect_share,
                      prompts=args.prompts, max_tokens=args.max_tokens, seed=args.seed, api_key=args.api_key,
                      min_tokens=min(8, args.max_tokens))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.url:
        report = asyncio.run(soak(args.url.rstrip("/"), options, log=log))
    else:
        from engine import EngineConfig

        overrides = {"model": args.model, "port": 0, "host": "127.0.0.1", "api_key": args.api_key}
        if args.model == "tiny-random":
            overrides["served_model_name"] = "tiny"
        report = asyncio.run(soak_in_process(options, EngineConfig.load(args.config, **overrides), log=log))
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
