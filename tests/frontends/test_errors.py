"""(d) Every bad input gets its status and an OpenAI-shaped error, and the server keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine
from frontends.http import create_app
from tests.frontends.conftest import serving, tiny_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]

# (path, body, status, param, message fragment)
BAD = [
    (COMPLETIONS, b"{not json", 400, None, "not valid JSON"),
    # msgspec called this "truncated" too (session 25 audit)
    (COMPLETIONS, b'{"prompt": "x", "cache_salt": "\\ud800"}', 400, None, "surrogate"),
    (COMPLETIONS, b"[]", 400, None, "Expected `object`"),
    (COMPLETIONS, b'{"max_tokens": 3}', 400, "prompt", "missing required field `prompt`"),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens", "Expected `int | null`, got `str`"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": "hot"}', 400, "temperature", "Expected `float | null`"),
    (COMPLETIONS, b'{"prompt": "x", "stream": "yes"}', 400, "stream", "Expected `bool | null`"),
    (COMPLETIONS, b'{"prompt": {"a": 1}}', 400, "prompt", "Expected `str | array`"),
    (COMPLETIONS, b'{"prompt": "x", "stream_options": {"include_usage": 1}}', 400, "stream_options.include_usage", "bool"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": -0.5}', 400, "temperature", "temperature must be in [0, 100]"),
    (COMPLETIONS, b'{"prompt": "x", "top_p": 0}', 400, "top_p", "top_p must be in (0, 1]"),
    (COMPLETIONS, b'{"prompt": "x", "top_p": 1.5}', 400, "top_p", "top_p must be in (0, 1]"),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", "max_tokens must be an integer >= 1"),
    (COMPLETIONS, b'{"prompt": "x", "stop": ""}', 400, "stop", "non-empty"),
    (COMPLETIONS, b'{"prompt": "x", "stop": ["a", ""]}', 400, "stop", "non-empty"),
    (COMPLETIONS, b'{"prompt": "x", "stop_token_ids": [-1]}', 400, "stop_token_ids", "non-negative"),
    (COMPLETIONS, b'{"prompt": "x", "n": 17}', 400, "n", "n must be an integer in [1, 16]"),
    (COMPLETIONS, b'{"prompt": "x", "n": 0}', 400, "n", "n must be an integer in [1, 16]"),
    (COMPLETIONS, b'{"prompt": "x", "n": 2, "best_of": 3}', 400, "best_of", "best_of is not supported"),
    (COMPLETIONS, b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options", "only allowed"),
    (COMPLETIONS, b'{"prompt": ""}', 400, "prompt", "prompt is empty"),
    (COMPLETIONS, b'{"prompt": [1, 2, 100000]}', 400, "prompt", "prompt token ids must be integers"),
    (COMPLETIONS, b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "The model `gpt-4` does not exist."),
    (CHAT, b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content", "Expected"),
    (CHAT, b'{"messages": [{"content": "x"}]}', 400, "messages[0].role", "missing required field `role`"),
    (CHAT, b'{"messages": "hi"}', 400, "messages", "Expected `array`"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "messages", "only text"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}', 400,
     "max_completion_tokens", "max_completion_tokens must be an integer >= 1"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens",
     "max_tokens must be an integer >= 1"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "min_tokens": 3}', 400,
     "min_tokens", "must not exceed max_completion_tokens (2)"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100000}', 400,
     "max_completion_tokens", "reduce the length of the messages or max_completion_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": "nope"}', 404, "model", "does not exist"),
    # a 500 with a RecursionError traceback, before: nesting ~1,000 deep, in the body or in a JSON string
    (COMPLETIONS, b'{"prompt": "x", "structured_outputs": {"json": ' + b"[" * 1000 + b"]" * 1000 + b"}}", 400, None,
     "request body is nested too deeply"),
    (COMPLETIONS, b'{"prompt": "x", "guided_json": "' + b"[" * 1000 + b"]" * 1000 + b'"}', 400, "guided_json",
     "the JSON schema is nested too deeply"),
    (COMPLETIONS, b'{"prompt": [-1, 5], "echo": true}', 400, "prompt", "prompt token ids must be integers"),  # was 500
    (COMPLETIONS, b'{"prompt": [5, 10000000000000], "echo": true}', 400, "prompt", "prompt token ids must be integers"),
    (COMPLETIONS, b'{"prompt": "x", "logit_bias": {" 5 ": 1}}', 400, "logit_bias", "keys must be token ids"),
    (COMPLETIONS, b'{"prompt": "x", "logit_bias": {"1_0": 1}}', 400, "logit_bias", "keys must be token ids"),
]


def assert_openai_error(data: dict, param: str | None = None, fragment: str = "") -> None:
    assert set(data) == {"error"}, data
    assert set(data["error"]) == {"message", "type", "param", "code"}, data
    assert isinstance(data["error"]["message"], str) and isinstance(data["error"]["type"], str)
    assert data["error"]["param"] == param, data
    assert fragment in data["error"]["message"], data


async def ok(client) -> None:
    resp = await client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 2


async def test_bad_inputs(tiny):
    _, client = tiny
    for path, body, status, param, fragment in BAD:
        streamable = body.startswith(b'{"') and b'"stream' not in body
        for data in [body, body[:-1] + b', "stream": true}'] if streamable else [body]:
            resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
            assert resp.status == status, (data, await resp.text())
            assert resp.content_type == "application/json"
            assert_openai_error(await resp.json(), param, fragment)
    await ok(client)


async def test_context_length(tiny):
    engine, client = tiny
    resp = await client.post(COMPLETIONS, json={"prompt": "a" * 2100, "max_tokens": 1})
    assert resp.status == 400
    data = await resp.json()
    assert_openai_error(data, "prompt", f"maximum context length is {engine.max_model_len} tokens")
    assert data["error"]["code"] == "context_length_exceeded"
    resp = await client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 2048})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"
    resp = await client.post(CHAT, json={"messages": [{"role": "user", "content": "a" * 2100}]})  # default max_tokens
    assert resp.status == 400  # chat has no `prompt`: the error names the field the client sent, as vLLM's does
    assert_openai_error(await resp.json(), "messages", "maximum context length is 2048 tokens")
    message = (await resp.json())["error"]["message"]  # no completion counted: the client asked for none
    assert "your messages resulted in" in message and "for the completion" not in message
    resp = await client.post(CHAT, json={"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 2048})
    assert (await resp.json())["error"]["param"] == "max_completion_tokens"
    await ok(client)


async def test_unknown_route_and_method(tiny):
    _, client = tiny
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert_openai_error(await resp.json())
    resp = await client.get(COMPLETIONS)
    assert resp.status == 405
    assert_openai_error(await resp.json())


async def test_body_too_large(tiny_model):
    async with serving(tiny_model, tiny_config(max_body_bytes=2048)) as (_, client):
        resp = await client.post(COMPLETIONS, json={"prompt": "a" * 4000})
        assert resp.status == 413
        data = await resp.json()
        assert_openai_error(data, None, "too large")
        assert data["error"]["code"] == "request_too_large"
        await ok(client)


async def test_api_key(tiny_model):
    async with serving(tiny_model, tiny_config(api_key="sk-secret")) as (_, client):
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-secret"}]:
            resp = await client.post(COMPLETIONS, json={"prompt": "x"}, headers=headers)
            assert resp.status == 401
            data = await resp.json()
            assert_openai_error(data, None, "API key")
            assert data["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status == 401
        assert (await client.get("/health")).status == 200  # public unless protect_health
        assert (await client.get("/metrics")).status == 200
        assert (await client.get("/version")).status == 200
        # not under /v1, but work a client could make expensive (a chat with thousands of tools)
        assert (await client.post("/tokenize", json={"prompt": "x"})).status == 401
        assert (await client.post("/detokenize", json={"tokens": [5]})).status == 401
        assert (await client.get("/nothing")).status == 401
        good = {"Authorization": "Bearer sk-secret"}
        resp = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}, headers=good)
        assert resp.status == 200
        state = await (await client.get("/v1/engine/state", headers=good)).json()
        assert state["config"]["server"]["api_key"] == "<redacted>"
        assert (await client.post("/tokenize", json={"prompt": "x"}, headers=good)).status == 200


async def test_a_refused_body_is_not_read_on(tiny_model):
    """A 401 came at once, but aiohttp then read (and inflated) the rest of the gzip body to keep
    the connection: 1 GiB of zeros per megabyte sent, without a key. It closes instead."""
    import gzip

    body = gzip.compress(b"0" * (64 << 20))  # 64 MiB inflated, ~64 KB sent
    async with serving(tiny_model, tiny_config(api_key="sk-secret")) as (_, client):
        resp = await client.post(COMPLETIONS, data=body, headers={"Content-Encoding": "gzip",
                                                                  "Content-Type": "application/json"})
        assert resp.status == 401 and resp.headers.get("Connection", "").lower() == "close"
        assert (await client.get("/health")).status == 200


async def test_queue_full_is_503_with_retry_after(tiny_model):
    # A long request holds the only slot; the next one waits for it and fills the queue. (A static
    # batch gathering requests no longer holds a full queue: it starts, as none could join it.)
    config = tiny_config(policy="continuous", max_num_seqs=1, max_waiting=1)
    async with serving(tiny_model, config) as (engine, client):
        long = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}
        running = asyncio.create_task(client.post(COMPLETIONS, json=long))
        while not engine.snapshot().running:
            await asyncio.sleep(0.01)
        first = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}))
        while not engine.snapshot().waiting:
            await asyncio.sleep(0.01)
        resp = await client.post(COMPLETIONS, json={"prompt": "y", "max_tokens": 1})
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        data = await resp.json()
        assert_openai_error(data, None, "waiting queue is full")
        assert data["error"]["code"] == "queue_full"
        first.cancel()  # disconnects: the waiting request is aborted and the queue empties
        running.cancel()
        while engine.snapshot().waiting or engine.snapshot().running:
            await asyncio.sleep(0.01)


async def test_a_batch_longer_than_the_queue_is_400_not_retry_later(tiny_model):
    """It was a 503 queue_full with Retry-After, though no retry could ever pass."""
    async with serving(tiny_model, tiny_config(max_waiting=2)) as (engine, client):
        resp = await client.post(COMPLETIONS, json={"prompt": ["a", "b", "c"], "max_tokens": 1})
        assert resp.status == 400
        assert_openai_error(await resp.json(), "prompt", "a batch of 3 prompts is more than the waiting queue")
        resp = await client.post(COMPLETIONS, json={"prompt": ["a", "b"], "max_tokens": 1})
        assert resp.status == 200 and len((await resp.json())["choices"]) == 2


async def test_engine_dead_is_503(tiny_model):
    def always_fail(plan):
        raise RuntimeError("device lost")

    async with serving(tiny_model, tiny_config(), fault_hook=always_fail) as (engine, client):
        for _ in range(3):  # three failed steps in a row kill the engine
            resp = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
            assert resp.status == 500
            assert_openai_error(await resp.json(), None, "device lost")
        while not engine.dead:
            await asyncio.sleep(0.01)
        resp = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
        assert resp.status == 503
        assert_openai_error(await resp.json(), None, "engine unavailable")
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "dead"


async def test_loading_is_503(tiny_model, aiohttp_client):
    engine = Engine(tiny_config(), loaded=tiny_model)  # not started yet
    client = await aiohttp_client(create_app(engine))
    health = await client.get("/health")
    assert health.status == 503 and await health.json() == {"status": "loading"}
    resp = await client.post(COMPLETIONS, json={"prompt": "x"})
    assert resp.status == 503
    assert_openai_error(await resp.json(), None, "loading")
    # a logprobs request while loading left the logprobs' token texts without a tokenizer for
    # good: every later logprobs request was a 500 (session 21 re-audit)
    assert (await client.post(COMPLETIONS, json={"prompt": "x", "logprobs": 1})).status == 503
    assert (await client.get("/metrics")).status == 200
    assert (await client.get("/v1/models")).status == 200
    await engine.start()
    try:
        assert (await client.get("/health")).status == 200
        await ok(client)
        resp = await client.post(COMPLETIONS, json={"prompt": "x", "logprobs": 1, "max_tokens": 2})
        assert resp.status == 200 and len((await resp.json())["choices"][0]["logprobs"]["tokens"]) == 2
    finally:
        await client.close()
        await engine.stop()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_bad_input_while_loading_is_still_400(tiny_model, aiohttp_client, path):
    client = await aiohttp_client(create_app(Engine(tiny_config(), loaded=tiny_model)))
    own = {"prompt": "x"} if path == COMPLETIONS else {"messages": HI}
    resp = await client.post(path, json={**own, "temperature": -1, "max_tokens": 3})
    assert resp.status == 400
    assert_openai_error(await resp.json(), "temperature", "temperature")


def test_a_lone_surrogate_is_not_called_truncated_input():
    from frontends.http.errors import ApiError
    from frontends.http.protocol import CompletionRequest, decode

    with pytest.raises(ApiError, match="lone UTF-16 surrogate escape"):
        decode(b'{"prompt": "x", "cache_salt": "\\ud800"}', CompletionRequest)
    with pytest.raises(ApiError, match="not valid JSON: Input data was truncated"):  # truly truncated
        decode(b'{"prompt": "\\ud83d\\ude00', CompletionRequest)
