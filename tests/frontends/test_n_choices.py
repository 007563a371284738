"""`n` > 1 through the official `openai` client on the tiny model: n choices with their
`index`, distinct when seeded; streamed chunks interleave the choices (each chunk one choice,
its own finish_reason) and reassemble to the whole response; usage counts the prompt once
and sums the completions; `best_of` and a bad `n` are refused naming the field."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from engine import Engine
from frontends.http import HttpFrontend
from tests.frontends.conftest import tiny_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
MAX_TOKENS = 10
PROMPT = [5, 17, 99, 42, 7, 250, 31, 64, 8, 11, 120]  # token ids: the tiny tokenizer's text is noise


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tiny_model):
    engine = Engine(tiny_config(policy="continuous"), loaded=tiny_model)
    frontend = HttpFrontend("127.0.0.1", 0)
    await frontend.start(engine)
    await engine.start()
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield engine, client
    await client.close()
    await frontend.stop()
    await engine.stop()


def sampled(**kw) -> dict:
    return dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, extra_body={"ignore_eos": True}, **kw)


async def test_completions_n3_seeded_distinct_choices(server):
    engine, client = server
    whole = await client.completions.create(prompt=PROMPT, n=3, **sampled())
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) == 3, texts
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.prompt_tokens == len(PROMPT)  # once, not per choice
    assert whole.usage.completion_tokens == 3 * MAX_TOKENS
    assert whole.usage.total_tokens == len(PROMPT) + 3 * MAX_TOKENS
    again = await client.completions.create(prompt=PROMPT, n=3, **sampled())
    assert [c.text for c in again.choices] == texts  # the seed fixes every choice
    one = await client.completions.create(prompt=PROMPT, **sampled())
    assert one.choices[0].text == texts[0]


async def test_completions_stream_interleaves_and_reassembles(server):
    _, client = server
    whole = await client.completions.create(prompt=PROMPT, n=2, **sampled())
    chunks = [c async for c in await client.completions.create(
        prompt=PROMPT, n=2, stream=True, stream_options={"include_usage": True}, **sampled())]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    body = [c for c in chunks if c.choices]
    assert all(len(c.choices) == 1 for c in body)
    order = [c.choices[0].index for c in body]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), f"choices not interleaved: {order}"
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]  # once, at its end
        assert mine[-1].finish_reason == choice.finish_reason


async def test_chat_stream_n2_reassembles_to_the_whole_response(server):
    _, client = server
    messages = [{"role": "user", "content": "hello there"}]
    whole = await client.chat.completions.create(messages=messages, n=2, **sampled())
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in whole.choices)
    assert whole.choices[0].message.content != whole.choices[1].message.content
    chunks = [c async for c in await client.chat.completions.create(
        messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **sampled())]
    assert chunks[-1].usage == whole.usage
    body = [c for c in chunks if c.choices]
    assert [c.choices[0].delta.role for c in body[:2]] == ["assistant", "assistant"]  # one opening per choice
    assert {c.choices[0].index for c in body[:2]} == {0, 1}
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]


async def test_greedy_n2_equals_n1(server):
    _, client = server
    one = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    two = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2


async def test_best_of_and_bad_n_are_refused(server):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=n)
        assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=0)
    assert e.value.body["param"] == "n"
