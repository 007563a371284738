"""Run a workload and time every token: in-process against an Engine, or remotely against
any OpenAI-compatible server (streaming /v1/completions with token-id prompts, ignore_eos)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from engine.bench.stats import RequestTiming
from engine.bench.workload import BenchRequest
from engine.engine import Engine
from engine.messages import StepRecord
from engine.request import SamplingParams


async def _paced(requests: list[BenchRequest], one: Callable, on_done: Callable[[], None]) -> tuple[list[RequestTiming], float]:
    start = time.perf_counter()

    async def launch(r: BenchRequest) -> RequestTiming:
        delay = start + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        timing = RequestTiming(tag=r.tag, arrival=time.perf_counter(), num_prompt_tokens=len(r.prompt_token_ids))
        try:
            await one(r, timing)
        except Exception:
            timing.ok = False
        timing.end = time.perf_counter()
        on_done()
        return timing

    timings = await asyncio.gather(*(launch(r) for r in requests))
    return list(timings), time.perf_counter() - start


def _mark(timing: RequestTiming, num_new: int) -> None:
    now = time.perf_counter()
    if num_new and timing.first_token is None:
        timing.first_token = now
    timing.token_times += [now] * num_new
    timing.num_output_tokens += num_new


async def run_in_process(
    engine: Engine, requests: list[BenchRequest], on_done: Callable[[], None] = lambda: None
) -> tuple[list[RequestTiming], float, list[StepRecord]]:
    steps: list[StepRecord] = []

    async def record() -> None:
        async for s in engine.steps():
            steps.append(s)

    recorder = asyncio.create_task(record())
    await asyncio.sleep(0)  # let the recorder subscribe before the first step

    async def one(r: BenchRequest, timing: RequestTiming) -> None:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(r.prompt_token_ids, params):
            _mark(timing, len(out.token_ids))
            if out.finish_reason in ("error", "abort"):
                timing.ok = False

    timings, duration = await _paced(requests, one, on_done)
    recorder.cancel()
    return timings, duration, steps


async def run_remote(
    url: str, model: str | None, requests: list[BenchRequest], api_key: str = "",
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestTiming], float]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        if model is None:
            async with session.get(f"{url}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]

        async def one(r: BenchRequest, timing: RequestTiming) -> None:
            body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                usage_tokens = None
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        _mark(timing, 1)  # servers send one chunk per token when streaming
                if usage_tokens is not None:
                    timing.num_output_tokens = usage_tokens

        timings, duration = await _paced(requests, one, on_done)
    return timings, duration
