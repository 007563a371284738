"""Issue #18's fields through the `openai` package on the tiny model: logprobs and echo
(lm-eval's `echo` + `logprobs` + `max_tokens: 0`), chat logprobs streamed and whole, the
sampling fields reaching the engine (penalties, min_p, logit_bias, min_tokens), and
refusals of bad values."""

from __future__ import annotations

import openai
import pytest
import torch

from frontends.http.protocol import ChatMessage, ContentPart

PROMPT = "The quick brown fox"


@pytest.fixture
async def api(tiny):
    engine, client = tiny
    oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    yield engine, oai
    await oai.close()


def raw_logprobs(engine, ids: list[int]) -> torch.Tensor:
    hf = engine._loaded.hf_model
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]


async def test_echo_logprobs_max_tokens_0_scores_the_prompt(api):
    """What lm-eval's local-completions sends to score a multiple-choice continuation."""
    engine, oai = api
    out = await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0)
    choice = out.choices[0]
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [engine.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = raw_logprobs(engine, ids)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        top = lp.top_logprobs[pos]
        assert lp.tokens[pos] in top and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(float(ref[pos - 1].max()), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


async def test_completion_logprobs_whole_and_streamed(api):
    engine, oai = api
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    whole = await oai.completions.create(**kw)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and max(top.values()) == logprob  # greedy: the chosen is the most likely
        assert 1 <= len(top) <= 4  # keyed by text: byte tokens that decode alike (U+FFFD) share a key
    assert lp.text_offset[0] == 0
    chunks = [c async for c in await oai.completions.create(**kw, stream=True)]
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert streamed == lp.tokens and offsets == lp.text_offset
    # a stop string's partial match holds text back while its tokens go out: offsets follow the tokens
    held = {**kw, "stop": [whole.choices[0].text[1] + "\x00"]}
    chunks = [c async for c in await oai.completions.create(**held, stream=True)]
    assert any(c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens and not c.choices[0].text
               for c in chunks)  # a chunk with a token and no text yet
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset if c.choices and c.choices[0].logprobs
                                           else [])]
    assert offsets == (await oai.completions.create(**held)).choices[0].logprobs.text_offset == lp.text_offset
    echoed = await oai.completions.create(**{**kw, "max_tokens": 2}, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT)
    n = len(engine.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert len(echoed.choices[0].logprobs.tokens) == n + 2 and echoed.choices[0].logprobs.token_logprobs[0] is None


async def test_chat_logprobs_whole_and_streamed(api):
    _, oai = api
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = await oai.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert isinstance(e.bytes, list)
    chunks = [c async for c in await oai.chat.completions.create(**kw, stream=True)]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = await oai.chat.completions.create(**{k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")})
    assert plain.choices[0].logprobs is None


async def test_sampling_fields_reach_the_engine(api):
    engine, oai = api
    ids = engine.tokenizer.encode("z", add_special_tokens=False)
    forced = await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1,
                                          logit_bias={str(ids[0]): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "zzzz"
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = await oai.completions.create(**kw)
    neutral = await oai.completions.create(**kw, presence_penalty=0, frequency_penalty=0)
    assert neutral.choices[0].text == plain.choices[0].text
    penalised = await oai.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].text != plain.choices[0].text or len(set(plain.choices[0].text)) == 8
    chat = await oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, temperature=0.9, seed=3,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "top_k": 5, "min_tokens": 3})
    assert chat.usage.completion_tokens == 3


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"999999": 1}), ("logprobs", 21), ("min_p", 1.5), ("repetition_penalty", 0), ("min_tokens", 99),
    ("stop_token_ids", [999999]), ("stop_token_ids", [-1]),
])
async def test_bad_values_are_400_naming_the_field(tiny, field, value):
    _, client = tiny
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, field: value})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == field


async def test_max_tokens_0_needs_echo_and_top_logprobs_needs_logprobs(tiny):
    _, client = tiny
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "top_logprobs": 2})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "top_logprobs"
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "logprobs": True, "top_logprobs": 21})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "top_logprobs" and "[0, 20]" in error["message"]


def test_content_parts_join_with_newlines_and_tool_history_is_kept():
    parts = ChatMessage(role="user", content=[ContentPart(type="text", text="a"), ContentPart(type="text", text="b")])
    assert parts.as_dict() == {"role": "user", "content": "a\nb"}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assistant = ChatMessage(role="assistant", content=None, tool_calls=[call]).as_dict()
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}  # as templates read it
    assert ChatMessage(role="tool", content="2", tool_call_id="c1").as_dict() == {
        "role": "tool", "content": "2", "tool_call_id": "c1"}



async def test_usage_reports_prefix_cache_hits(tiny):
    _, client = tiny
    body = {"prompt": "a long enough prompt to fill two KV blocks of sixteen tokens each.", "max_tokens": 2}
    first = (await (await client.post("/v1/completions", json=body)).json())["usage"]
    second = (await (await client.post("/v1/completions", json=body)).json())["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"]["cached_tokens"] >= 32


async def test_model_name_defaults_to_the_loaded_model_and_its_path_is_accepted(tiny_model):
    from tests.frontends.conftest import serving, tiny_config

    async with serving(tiny_model, tiny_config(served_model_name="")) as (engine, client):
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-random"]
        for name in ("tiny-random", engine.config.model.model):
            resp = await client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
            assert resp.status == 200
        resp = await client.post("/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 1})
        assert resp.status == 404


def test_top_logprobs_keyed_alike_keep_the_likeliest_and_the_chosen_its_own():
    """Tokens rendering alike (partial UTF-8 bytes: U+FFFD) share a key: the least likely one's
    value won, contradicting token_logprobs when the chosen token was among them."""
    from engine.messages import TokenLogprob
    from frontends.http.logprobs import completion_logprobs

    class Texts:
        def text(self, token_id: int) -> str:
            return {1: "\ufffd", 2: "\ufffd", 3: "a", 4: "\ufffd"}[token_id]

    top = [(1, -0.9), (3, -1.2), (2, -1.7), (4, -2.7)]
    greedy = completion_logprobs([TokenLogprob(1, -0.9, top)], Texts(), 0)
    assert greedy.top_logprobs == [{"\ufffd": -0.9, "a": -1.2}] and greedy.token_logprobs == [-0.9]
    sampled = completion_logprobs([TokenLogprob(2, -1.7, top)], Texts(), 0)  # a less likely one, sampled
    assert sampled.top_logprobs[0]["\ufffd"] == sampled.token_logprobs[0] == -1.7


async def test_cache_salt_keeps_prefix_cache_hits_between_requests_of_the_same_salt(tiny):
    """vLLM's cache_salt: without it, a client guessing another's prompt saw cached_tokens rise."""
    _, client = tiny
    prompt = "a private prompt long enough to fill two KV blocks of sixteen tokens: 0451-7782"

    async def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached("alice") == 0
    assert await cached(None) == 0 and await cached("bob") == 0  # another salt, or none: nothing shared
    assert await cached("alice") >= 32
    resp = await client.post("/v1/completions", json={"prompt": "x", "cache_salt": ""})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "cache_salt"


BOS = 0


@pytest.fixture
def bos_tokenizer(tiny, monkeypatch):
    """The tiny model's tokenizer made to add a BOS, as Llama 3's and Gemma's do."""
    engine, _ = tiny
    tok, plain = engine.tokenizer, engine.tokenizer.encode

    def encode(text, *args, add_special_tokens=True, **kw):
        ids = plain(text, *args, add_special_tokens=False, **kw)
        return [BOS, *ids] if add_special_tokens else ids

    monkeypatch.setattr(tok, "encode", encode)
    return tok


async def test_add_special_tokens_on_completions(api, bos_tokenizer):
    """It was refused unless false, and false was ignored: the BOS was added all the same."""
    _, oai = api
    n = len(bos_tokenizer.encode(PROMPT, add_special_tokens=False))
    for value, expected in ((None, n + 1), (True, n + 1), (False, n)):
        extra = {} if value is None else {"add_special_tokens": value}
        for prompt in (PROMPT, [PROMPT, PROMPT]):
            out = await oai.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
            assert out.usage.prompt_tokens == expected * (1 if prompt == PROMPT else 2), (value, prompt)
    out = await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                       extra_body={"add_special_tokens": False})
    assert out.choices[0].text == PROMPT and len(out.choices[0].logprobs.tokens) == n
    with pytest.raises(openai.BadRequestError) as e:
        await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"add_special_tokens": 1})
    assert e.value.body["param"] == "add_special_tokens"


async def test_add_special_tokens_on_chat(api, bos_tokenizer):
    """vLLM's chat default is false (the template writes them); true adds the tokenizer's own."""
    _, oai = api
    messages = [{"role": "user", "content": PROMPT}]
    base = (await oai.chat.completions.create(model="tiny", messages=messages, max_tokens=1)).usage.prompt_tokens
    for value, expected in ((False, base), (True, base + 1)):
        for max_tokens in (1, None):  # the engine renders the prompt, or the frontend does to size max_tokens
            out = await oai.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                    extra_body={"add_special_tokens": value})
            assert out.usage.prompt_tokens == expected, (value, max_tokens)


async def test_neutral_values_of_newer_sdk_fields(api):
    """`stream_options.include_obfuscation: false` and `metadata: {}` ask for nothing and were
    refused; obfuscation itself is refused by name."""
    _, oai = api
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=2)
    chunks = [c async for c in await oai.completions.create(
        **kw, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})]
    assert chunks[-1].usage.completion_tokens == 2
    await oai.completions.create(**kw, extra_body={"metadata": {}})
    with pytest.raises(openai.BadRequestError) as e:
        await oai.completions.create(**kw, stream=True, stream_options={"include_obfuscation": True})
    assert e.value.body["param"] == "stream_options.include_obfuscation" and e.value.body["code"] == "unsupported_field"
    for field, value in (("metadata", {"k": "v"}), ("prompt_cache_retention", "24h")):
        with pytest.raises(openai.BadRequestError) as e:
            await oai.completions.create(**kw, extra_body={field: value})
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_field"
