"""Run a workload and time every token: in-process against an Engine, or remotely against
any OpenAI-compatible server (streaming /v1/completions with token-id prompts, ignore_eos).

`token_times` holds one time per delivery: in-process an output (one token per step),
remotely a content chunk (a token is seen only when its text is, so one chunk may carry
several); the remote output token count comes from the final usage chunk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from engine.bench.stats import RequestTiming
from engine.bench.workload import BenchRequest
from engine.engine import Engine
from engine.messages import StepRecord
from engine.request import SamplingParams
from frontends.http import sse

GATE_POLL_S = 0.02  # how often a gated request checks the run's token count (rarely: the
# event loop shares the GIL with the executor's thread, so busy polling would slow the steps)
RECORD_WAIT_S = 5.0  # how long to wait for the last step's record after the last request


async def _paced(requests: list[BenchRequest], one: Callable, on_done: Callable[[], None]) -> tuple[list[RequestTiming], float]:
    """Send each request at its arrival offset (and, if gated, once the run has received
    `after_tokens` output tokens in all); time it with `one(request, timing)`."""
    start = time.perf_counter()
    started: list[RequestTiming] = []
    ungated_left = sum(1 for r in requests if not r.after_tokens)

    async def launch(r: BenchRequest) -> RequestTiming:
        nonlocal ungated_left
        delay = start + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        # a gate that can no longer open (every ungated request is done) opens anyway
        while r.after_tokens and ungated_left and sum(t.num_output_tokens for t in started) < r.after_tokens:
            await asyncio.sleep(GATE_POLL_S)
        if r.after_gate_s:
            await asyncio.sleep(r.after_gate_s)
        timing = RequestTiming(tag=r.tag, arrival=time.perf_counter(), num_prompt_tokens=len(r.prompt_token_ids))
        started.append(timing)
        try:
            await one(r, timing)
        except Exception as e:
            timing.ok = False
            timing.error = timing.error or f"{type(e).__name__}: {e}"
        timing.end = time.perf_counter()
        if not r.after_tokens:
            ungated_left -= 1
        on_done()
        return timing

    timings = await asyncio.gather(*(launch(r) for r in requests))
    return list(timings), time.perf_counter() - start


def _mark(timing: RequestTiming, num_new: int) -> None:
    """A delivery of `num_new` tokens: one timestamp, however many tokens (several tokens that
    arrive together are one gap for the reader, not gaps of zero)."""
    if not num_new:
        return
    now = time.perf_counter()
    if timing.first_token is None:
        timing.first_token = now
    timing.token_times.append(now)
    timing.num_output_tokens += num_new


async def run_in_process(
    engine: Engine, requests: list[BenchRequest], on_done: Callable[[], None] = lambda: None
) -> tuple[list[RequestTiming], float, list[StepRecord]]:
    steps: list[StepRecord] = []

    async def record() -> None:
        async for s in engine.steps():
            if not s.is_idle:
                steps.append(s)

    recorder = asyncio.create_task(record())
    await asyncio.sleep(0)  # let the recorder subscribe before the first step

    async def one(r: BenchRequest, timing: RequestTiming) -> None:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(r.prompt_token_ids, params):
            _mark(timing, len(out.token_ids))
            if out.finish_reason in ("error", "abort"):
                timing.ok = False
                timing.error = f"finish_reason {out.finish_reason}: {out.error}"

    timings, duration = await _paced(requests, one, on_done)
    # The scheduler publishes a step's record after handing out its tokens: wait for the
    # record of the last step taken, so the step figures cover the whole run.
    last = getattr(getattr(engine, "scheduler", None), "step", 0)
    deadline = time.perf_counter() + RECORD_WAIT_S
    while (not steps or steps[-1].step < last) and not recorder.done() and time.perf_counter() < deadline:
        await asyncio.sleep(0.001)
    recorder.cancel()
    await asyncio.gather(recorder, return_exceptions=True)
    return timings, duration, steps


class RemoteError(Exception):
    """The server under test refused the run itself (not one request): a wrong key, a wrong URL."""


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(url: str, api_key: str = "") -> str:
    """The first model the server at `url` lists on /v1/models (the one it serves)."""
    import aiohttp

    async with aiohttp.ClientSession(headers=_auth(api_key)) as session, session.get(f"{url}/v1/models") as resp:
        if resp.status != 200:
            raise RemoteError(f"GET {url}/v1/models: HTTP {resp.status}: {(await resp.text()).strip()[:300]}")
        return (await resp.json())["data"][0]["id"]


async def run_remote(
    url: str, model: str | None, requests: list[BenchRequest], api_key: str = "",
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestTiming], float]:
    import aiohttp

    if model is None:
        model = await served_model(url, api_key)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(headers=_auth(api_key), timeout=timeout) as session:
        async def one(r: BenchRequest, timing: RequestTiming) -> None:
            body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                usage_tokens, finish_reason = None, None
                async for data in sse.events(resp.content):
                    chunk = sse.decode(data)
                    if chunk == "[DONE]":
                        continue
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    for choice in chunk.get("choices") or []:
                        # A content chunk carries one or more tokens (a server holds back a token
                        # that ends mid-character, and sends it with the next). A chunk with
                        # empty text counts too, unless it only says the stream is finished.
                        if choice.get("text") or not choice.get("finish_reason"):
                            _mark(timing, 1)
                        finish_reason = choice.get("finish_reason") or finish_reason
                if finish_reason is None:
                    raise RuntimeError("the stream ended without a finish_reason")
                if usage_tokens is not None:  # exact, where chunks may hold several tokens
                    timing.num_output_tokens = usage_tokens
                # every target must do the same work: max_tokens tokens, whatever they are
                if finish_reason != "length" or timing.num_output_tokens > r.max_tokens or (
                        usage_tokens is not None and usage_tokens < r.max_tokens):
                    raise RuntimeError(f"finish_reason {finish_reason!r} after {timing.num_output_tokens} of "
                                       f"{r.max_tokens} tokens: the server must honour ignore_eos and max_tokens")

        timings, duration = await _paced(requests, one, on_done)
    return timings, duration
