"""(3) Step failure isolation over HTTP (tiny model, a fault injected into the forward step).

One failed step: exactly the requests in it end — finish_reason "error" in the engine, an
SSE error event then [DONE] on the wire (their streams had already started) — while requests
outside it finish with their reference text; the server keeps serving and /health stays
200 throughout. Repeated failures (fatal): in-flight streams end with an error event, /health
turns 503 and new requests get a clear 503 at once — nothing ever hangs."""

from __future__ import annotations

import asyncio
import threading

import aiohttp

from tests.reliability.util import (
    CHAT, COMPLETIONS, assert_no_leaks, is_openai_error, live_server, sse_events, stream_text, tiny_config, wait_for,
)

DOOMED = "DOOMED request: "
TOKENS_BEFORE_FAULT = 4  # the fault hits once the doomed stream has sent a few tokens


class Fault:
    """fault_hook (runs in the executor thread before each step). Fails the first step in which
    the doomed request decodes, a few tokens in, next to other requests; with `fatal` set,
    fails every step."""

    def __init__(self, tokenizer):
        self.marker = tokenizer.encode(DOOMED, add_special_tokens=False)
        self.doomed: dict[str, int] = {}  # request id -> prompt length
        self.failed_ids: set[str] | None = None
        self.failed_step: int | None = None
        self.fatal = threading.Event()

    def __call__(self, plan) -> None:
        if self.fatal.is_set():
            raise RuntimeError("device lost (injected)")
        for it in plan.items:
            if it.kind == "prefill" and it.start_pos == 0 and it.token_ids[: len(self.marker)] == self.marker:
                self.doomed[it.request_id] = -1
            if it.request_id in self.doomed and it.kind == "decode" and self.doomed[it.request_id] < 0:
                self.doomed[it.request_id] = it.start_pos  # first decode: prompt + 1 tokens so far
        others = [it for it in plan.items if it.kind != "padding" and it.request_id not in self.doomed]
        if self.failed_ids is None and others and any(
            it.request_id in self.doomed and it.kind == "decode" and it.start_pos >= self.doomed[it.request_id] + TOKENS_BEFORE_FAULT
            for it in plan.items
        ):
            self.failed_ids = {it.request_id for it in plan.items if it.kind != "padding"}
            self.failed_step = plan.step
            raise RuntimeError("injected fault in one step")


async def stream(http: aiohttp.ClientSession, path: str, data: dict, started: bool = True) -> tuple[str, list]:
    """(request id, SSE events). A request that fails before its first output gets a plain
    500 OpenAI error instead (nothing was streamed yet): allowed unless `started`; returned
    as ("", [error])."""
    async with http.post(path, json={**data, "stream": True}) as resp:
        if resp.status == 200:
            return resp.headers["X-Request-Id"], sse_events(await resp.read())
        assert not started and resp.status == 500, await resp.text()
        return resp.headers.get("X-Request-Id", ""), [await resp.json()]


def bodies(prefix: str, n: int, max_tokens: int) -> list[tuple[str, dict]]:
    out = []
    for i in range(n):
        common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if i % 2:
            out.append((CHAT, {"messages": [{"role": "user", "content": f"{prefix} {i}"}], **common}))
        else:
            out.append((COMPLETIONS, {"prompt": f"{prefix} {i}", **common}))
    return out


async def health_watch(http: aiohttp.ClientSession, stop: asyncio.Event, statuses: list[int]) -> None:
    while not stop.is_set():
        async with http.get("/health") as resp:
            statuses.append(resp.status)
        try:
            await asyncio.wait_for(stop.wait(), 0.02)
        except TimeoutError:
            pass


async def test_one_failed_step_fails_only_its_requests(tiny_model):
    # max_num_seqs=3: the doomed request and two others run together; three more wait their turn
    config = tiny_config(max_num_seqs=3, num_blocks=256)
    hook = Fault(tiny_model.tokenizer)
    others = bodies("innocent", 5, 24)
    doomed = (COMPLETIONS, {"prompt": DOOMED + "please", "max_tokens": 200, "temperature": 0, "ignore_eos": True})
    async with asyncio.timeout(90), live_server(tiny_model, config, fault_hook=hook) as (engine, frontend):
        async with aiohttp.ClientSession(frontend.url) as http:
            reference = [stream_text((await stream(http, p, d))[1][:-1]) for p, d in others]
            finished: dict[str, str] = {}

            async def record_finishes() -> None:
                async for rec in engine.steps():
                    for f in rec.finished:
                        finished[f.request_id] = f.finish_reason

            recorder = asyncio.create_task(record_finishes())
            await wait_for(lambda: engine._subscribers, 5, "the step subscription")
            stop, health = asyncio.Event(), []
            watcher = asyncio.create_task(health_watch(http, stop, health))
            first = asyncio.create_task(stream(http, *doomed))
            await wait_for(lambda: hook.doomed, 10, "the doomed request to be scheduled")
            results = await asyncio.gather(first, *(stream(http, p, d, started=False) for p, d in others))
            stop.set()
            await watcher

            assert hook.failed_ids and hook.failed_step is not None
            doomed_id, doomed_events = results[0]
            assert doomed_id in hook.failed_ids and len(hook.failed_ids) >= 2  # it shared the step with others
            # its stream had started: chunks (maybe), then the error event, then [DONE]
            assert doomed_events[-1] == "[DONE]" and is_openai_error(doomed_events[-2])
            failed, survivors = [], 0
            for k, (rid, events) in enumerate(results):
                error = next((e for e in events if isinstance(e, dict) and "error" in e), None)
                if error is not None:
                    assert is_openai_error(error) and error["error"]["code"] == "engine_error", error
                    assert "injected fault" in error["error"]["message"]
                    assert rid == "" or (rid in hook.failed_ids and events[-1] == "[DONE]"), (rid, events)
                    failed.append(rid)
                else:
                    assert rid not in hook.failed_ids and events[-1] == "[DONE]"
                    assert stream_text(events[:-1]) == reference[k - 1]
                    survivors += 1
            assert len(failed) == len(hook.failed_ids)  # only the failed step's requests failed
            assert survivors >= 2  # the requests that were waiting ran after the failure, unharmed
            await wait_for(lambda: hook.failed_ids <= finished.keys() and len(finished) >= len(others) + 1, 5,
                           "every finish to be published")
            assert {r for r, why in finished.items() if why == "error"} == hook.failed_ids
            assert all(why == "length" for r, why in finished.items() if r not in hook.failed_ids)

            # still serving: the same prompt as the failed one now succeeds, /health never wavered
            again = await stream(http, doomed[0], {**doomed[1], "prompt": "after the fault", "max_tokens": 5})
            assert again[1][-2]["choices"][0]["finish_reason"] == "length"
            assert health and set(health) == {200}, health
            assert not engine.dead
            print(f"\nfailed step {hook.failed_step}: its {len(hook.failed_ids)} requests ended with an error, "
                  f"{survivors} others unaffected; /health probed {len(health)} times, all 200")
            recorder.cancel()
        await assert_no_leaks(engine, frontend)


async def test_repeated_failures_are_fatal_but_never_hang(tiny_model):
    hook = Fault(tiny_model.tokenizer)
    async with asyncio.timeout(60), live_server(tiny_model, tiny_config(), fault_hook=hook) as (engine, frontend):
        async with aiohttp.ClientSession(frontend.url) as http:
            # long streams in flight when the executor starts failing for good
            live = [asyncio.create_task(stream(http, p, d)) for p, d in bodies("long", 4, 1000)]
            await wait_for(lambda: sum(r.num_generated_tokens > 2 for r in engine.snapshot().running) == 4, 20,
                           "four streams to be under way")
            hook.fatal.set()
            outcomes = []
            for _ in range(10):  # keep asking, as a busy client would: each answer comes, none hangs
                async with http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3}) as resp:
                    payload = await resp.json()
                    outcomes.append(resp.status)
                    assert is_openai_error(payload), payload
                if resp.status == 503:
                    break
            assert outcomes[-1] == 503 and set(outcomes) <= {500, 503}, outcomes
            assert payload["error"]["code"] == "engine_unavailable" and "3 steps in a row" in payload["error"]["message"]
            for task in live:  # in-flight streams ended with an error event, then [DONE]
                _, events = await task
                assert events[-1] == "[DONE]" and is_openai_error(events[-2]), events[-2:]
            async with http.get("/health") as resp:
                assert resp.status == 503 and (await resp.json())["status"] == "dead"
            for path, data in [(COMPLETIONS, {"prompt": "y", "stream": True}),
                               (CHAT, {"messages": [{"role": "user", "content": "z"}]})]:
                async with http.post(path, json=data) as resp:
                    assert resp.status == 503
                    assert (await resp.json())["error"]["code"] == "engine_unavailable"
            print(f"\nfatal: answers after the executor broke: {outcomes}; /health 503, new requests 503")
        assert engine.dead and not engine.scheduler.requests and not engine._live
