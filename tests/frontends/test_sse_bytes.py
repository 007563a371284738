"""(b) The exact bytes of scripted streams on the tiny model, greedy, with a fixed id and
clock. The expected bodies are written out by hand from the engine's own deltas for the same
request, so every byte of framing and every field of the OpenAI chunk shapes is pinned."""

from __future__ import annotations

import itertools
import json

from engine import SamplingParams
from tests.frontends.conftest import serving, tiny_config

CREATED = 1700000000


def js(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def fixed_ids():
    counter = itertools.count()
    return lambda prefix: f"{prefix}-{next(counter)}"


async def reference(engine, prompt=None, messages=None, **params):
    return [o async for o in engine.generate(prompt, SamplingParams(**params), messages=messages)]


async def test_completion_stream_exact_bytes(tiny_model):
    async with serving(tiny_model, tiny_config(), new_id=fixed_ids(), clock=lambda: CREATED) as (engine, client):
        ref = await reference(engine, "Hello", max_tokens=6, temperature=0.0)
        resp = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        })
        body = await resp.read()
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    head = '{"id":"cmpl-0","object":"text_completion","created":1700000000,"model":"tiny"'
    expected = "".join(
        f'data: {head},"choices":[{{"index":0,"text":{js(o.text)},"logprobs":null,'
        f'"finish_reason":{js(o.finish_reason)}}}],"usage":null}}\n\n'
        for o in ref if o.text or o.finished
    )
    expected += f'data: {head},"choices":[],"usage":{{"prompt_tokens":5,"completion_tokens":6,"total_tokens":11,"prompt_tokens_details":{{"cached_tokens":0}}}}}}\n\n'
    expected += "data: [DONE]\n\n"
    assert ref[-1].finish_reason == "length" and sum(len(o.token_ids) for o in ref) == 6
    assert body.decode() == expected


async def test_chat_stream_exact_bytes(tiny_model):
    messages = [{"role": "user", "content": "hi"}]
    async with serving(tiny_model, tiny_config(), new_id=fixed_ids(), clock=lambda: CREATED) as (engine, client):
        ref = await reference(engine, messages=messages, max_tokens=4, temperature=0.0)
        resp = await client.post("/v1/chat/completions", json={
            "messages": messages, "max_completion_tokens": 4, "temperature": 0, "stream": True,
        })
        body = await resp.read()
    head = '{"id":"chatcmpl-0","object":"chat.completion.chunk","created":1700000000,"model":"tiny"'
    expected = f'data: {head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n'
    for o in ref:
        if not (o.text or o.finished):
            continue
        delta = f'{{"content":{js(o.text)}}}' if o.text else "{}"
        expected += (f'data: {head},"choices":[{{"index":0,"delta":{delta},"logprobs":null,'
                     f'"finish_reason":{js(o.finish_reason)}}}]}}\n\n')
    expected += "data: [DONE]\n\n"
    assert resp.status == 200
    assert body.decode() == expected


async def test_non_streamed_objects(tiny_model):
    async with serving(tiny_model, tiny_config(), new_id=fixed_ids(), clock=lambda: CREATED) as (engine, client):
        ref = await reference(engine, [72, 105], max_tokens=3, temperature=0.0)  # token ids as the prompt
        text = "".join(o.text for o in ref)
        resp = await client.post("/v1/completions", json={"prompt": [72, 105], "max_tokens": 3, "temperature": 0})
        assert await resp.read() == (
            '{"id":"cmpl-0","object":"text_completion","created":1700000000,"model":"tiny","choices":[{"index":0,'
            f'"text":{js(text)},"logprobs":null,"finish_reason":"length"}}],'
            '"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":0}}}'
        ).encode()
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 2, "temperature": 0})
        data = await resp.json()
    assert data["id"] == "chatcmpl-1" and data["object"] == "chat.completion" and data["created"] == CREATED
    assert data["choices"][0]["message"]["role"] == "assistant" and data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 2


async def test_engine_error_mid_stream_is_an_sse_error_event(tiny_model):
    """A step that fails after the first tokens ends the stream with an error event and [DONE]."""
    steps = itertools.count()

    def fail_fourth_step(plan):
        if any(i.kind == "decode" for i in plan.items) and next(steps) == 2:
            raise RuntimeError("injected fault")

    async with serving(tiny_model, tiny_config(), fault_hook=fail_fourth_step, new_id=fixed_ids(),
                       clock=lambda: CREATED) as (engine, client):
        resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10, "temperature": 0,
                                                          "ignore_eos": True, "stream": True})
        body = await resp.read()
        events = [json.loads(f[6:]) for f in body.decode().split("\n\n")[:-3]]
        assert all(e["object"] == "text_completion" and e["choices"][0]["finish_reason"] is None for e in events)
        assert body.decode().endswith(
            'data: {"error":{"message":"generation failed: RuntimeError: injected fault","type":"server_error",'
            '"param":null,"code":"engine_error"}}\n\ndata: [DONE]\n\n'
        )
        ok = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status == 200  # one failed step does not kill the engine
