"""POST /tokenize, /detokenize and GET /version in vLLM's shapes."""

from __future__ import annotations


async def test_tokenize_detokenize_round_trip(tiny):
    engine, client = tiny
    resp = await client.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    body = await resp.json()
    ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
    assert resp.status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == engine.max_model_len and len(body["token_strs"]) == len(ids)
    resp = await client.post("/detokenize", json={"tokens": ids})
    assert (await resp.json()) == {"prompt": "Hello there"}
    messages = [{"role": "user", "content": "hi"}]
    chat = await (await client.post("/tokenize", json={"messages": messages})).json()
    usage = (await (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}))
             .json())["usage"]
    assert chat["count"] == usage["prompt_tokens"]


async def test_tokenize_errors_and_version(tiny):
    _, client = tiny
    resp = await client.post("/tokenize", json={})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    resp = await client.post("/detokenize", json={"tokens": [10**9]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"
    for path, body in (("/tokenize", {"prompt": "hi", "add_generation_prompt": False}),
                       ("/detokenize", {"tokens": [1], "skip_special_tokens": False})):
        resp = await client.post(path, json=body)  # a field it does not have: never silently ignored
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == next(iter(body.keys() - {"prompt", "tokens"})), error
    resp = await client.get("/version")
    assert resp.status == 200 and isinstance((await resp.json())["version"], str)


async def test_tokenize_renders_tools_as_chat_does(tiny):
    """/tokenize refused `tools`, so a client could not see how its tools reach the model."""
    _, client = tiny
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = await (await client.post("/tokenize", json={"messages": messages})).json()
    with_tools = await (await client.post("/tokenize", json={"messages": messages, "tools": tools})).json()
    usage = (await (await client.post("/v1/chat/completions", json={
        "messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 1})).json())["usage"]
    assert with_tools["count"] == usage["prompt_tokens"] > plain["count"]
    resp = await client.post("/tokenize", json={"prompt": "hi", "tools": tools})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tools"
    resp = await client.post("/tokenize", json={"messages": messages, "tools": [{"type": "function",
                                                                                "function": {"name": "a b"}}]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tools[0].function.name"
