"""(c) Clients that leave abort their requests at once: 20 streams closed after their first
chunk, 5 closed while their long prompts are still being prefilled (nothing written to
them yet). Within a second none of them is queued or running, and once the streams that
stayed are done the gauges read zero; those streams get exactly the text they would have
got alone."""

from __future__ import annotations

import asyncio
import time

from engine import SamplingParams
from tests.frontends.conftest import get_metric, serving, sse_events, tiny_config

COMPLETIONS = "/v1/completions"
LONG = 1800  # prompt tokens (byte-level tokenizer: one per character)


def slow_steps(plan) -> None:
    time.sleep(0.01)  # runs in the executor thread: gives prefill a measurable duration


async def read_stream(client, body: dict) -> tuple[str, str]:
    resp = await client.post(COMPLETIONS, json=body)
    assert resp.status == 200
    events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    return resp.headers["X-Request-Id"], "".join(e["choices"][0]["text"] for e in events[:-1])


async def quit_after_first_chunk(client, i: int) -> str:
    resp = await client.post(COMPLETIONS, json={"prompt": f"quitter {i}", "max_tokens": 500, "temperature": 0,
                                                "ignore_eos": True, "stream": True})
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b'data: {"id":')
    resp.close()  # drop the connection mid-stream
    return resp.headers["X-Request-Id"]


async def wait_until(predicate, timeout: float, poll: float = 0.005) -> float:
    start = time.perf_counter()
    while not predicate():
        assert time.perf_counter() - start < timeout, "timed out"
        await asyncio.sleep(poll)
    return time.perf_counter() - start


async def test_disconnects_abort_at_once(tiny_model):
    # chunk 16 at >= 10 ms a step: a long prompt needs > 1 s more prefill after its first chunk,
    # so "gone within a second" holds only if the disconnect itself aborted it.
    config = tiny_config(num_blocks=1024, max_num_batched_tokens=48, chunk_size=16)
    async with serving(tiny_model, config, fault_hook=slow_steps) as (engine, client):
        stayers = [{"prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
                   for p in ("Once upon", "Twice", "Thrice over")]
        expected = []
        for body in stayers:
            outs = [o async for o in engine.generate(body["prompt"], SamplingParams(**{k: v for k, v in body.items() if k != "prompt"}))]
            expected.append("".join(o.text for o in outs))
        stay = [asyncio.create_task(read_stream(client, {**b, "stream": True})) for b in stayers]

        quitters = set(await asyncio.gather(*[quit_after_first_chunk(client, i) for i in range(20)]))

        # Long prompts: the headers come at once, the first body bytes with the first token; so
        # closing before those (cancelling the reader closes the response) is a disconnect during prefill.
        async def until_first_token(body: dict) -> None:
            resp = await client.post(COMPLETIONS, json=body)
            try:
                await resp.content.readany()
            finally:
                resp.close()

        long_posts = {LONG + i: asyncio.create_task(until_first_token({
            "prompt": chr(ord("A") + i) * (LONG + i), "max_tokens": 5, "stream": True})) for i in range(5)}
        while long_posts:
            for r in engine.snapshot().running:
                if r.num_prompt_tokens in long_posts and 0 < r.num_computed_tokens < r.num_prompt_tokens:
                    long_posts.pop(r.num_prompt_tokens).cancel()
            assert not any(t.done() for t in long_posts.values()), "a long prompt finished prefill first"
            await asyncio.sleep(0.002)
        closed_at = time.perf_counter()

        def gone() -> bool:
            snap = engine.snapshot()
            live = snap.running + snap.waiting
            return not any(r.request_id in quitters or r.num_prompt_tokens >= LONG for r in live)

        elapsed = await wait_until(gone, timeout=1.0)
        print(f"\n25 disconnected requests gone {elapsed * 1000:.0f} ms after the last close")

        results = await asyncio.gather(*stay)
        assert [text for _, text in results] == expected  # the streams that stayed are unaffected
        done_at = time.perf_counter()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            while await get_metric(client, name) != 0:
                assert time.perf_counter() - done_at < 1.0, f"{name} still non-zero"
                await asyncio.sleep(0.01)
        print(f"gauges zero {(time.perf_counter() - closed_at):.2f} s after the last close")

        resp = await client.post(COMPLETIONS, json={"prompt": "flush", "max_tokens": 1})  # one more step publishes
        assert resp.status == 200  # the aborts that happened while the engine was idle
        await asyncio.sleep(0.05)
        assert await get_metric(client, "vllm:request_success_total", finished_reason="abort") == 25


async def test_a_client_gone_before_the_first_event_is_an_abort_not_a_server_error(tiny_model, monkeypatch, caplog):
    """The connection resets while the SSE headers go out (soak.py saw it): the request is aborted
    and nothing is logged as an unhandled error."""
    from aiohttp import ClientConnectionResetError

    from frontends.http import sse

    async def reset(request, headers=None):
        raise ClientConnectionResetError("Cannot write to closing transport")

    async with serving(tiny_model, tiny_config()) as (engine, client):
        monkeypatch.setattr(sse, "open_stream", reset)
        resp = await client.post(COMPLETIONS, json={"prompt": "gone", "max_tokens": 50, "stream": True})
        assert resp.status == 200
        await wait_until(lambda: not engine.scheduler.requests, 5)
        assert await get_metric(client, "vllm:num_requests_running") == 0
    assert "unhandled error" not in caplog.text
