"""(a) The official `openai` client against a live server on the real model: chat and
completions, streamed and not; greedy streamed text equals non-streamed text; usage counts
match the tokenizer and the generated tokens."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from engine import EngineConfig, SamplingParams
from tests.frontends.conftest import openai_serving

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

API_KEY = "sk-stepwise-test"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(real_model):
    config = EngineConfig.load(None, num_blocks=256, api_key=API_KEY, served_model_name=MODEL)
    async with openai_serving(real_model, config, api_key=API_KEY, timeout=120) as pair:
        yield pair


async def generated_tokens(engine, prompt=None, messages=None) -> int:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return sum([len(o.token_ids) async for o in engine.generate(prompt, params, messages=messages)])


async def test_completions(server):
    engine, client = server
    prompt = "The three primary colors are"
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.object == "text_completion" and whole.model == MODEL and whole.id.startswith("cmpl-")
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and streamed
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert whole.usage.completion_tokens == await generated_tokens(engine, prompt)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


async def test_chat(server):
    engine, client = server
    messages = [{"role": "user", "content": "Name one fruit."}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage  # the same but for cached_tokens: the second request hits the prefix cache
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens_details.cached_tokens
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert whole.usage.completion_tokens == await generated_tokens(engine, messages=messages)


async def test_models_and_errors(server):
    _, client = server
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)
    assert e.value.body["param"] == "top_p"
    wrong = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.retrieve(MODEL)
    await wrong.close()


async def test_models_retrieve(server):
    """The SDK's models.retrieve was a bare 404 "Not Found": under either of its names (the
    configured one may hold a "/") the served model's card, else model_not_found."""
    engine, client = server
    for name in (MODEL, engine.config.model.model):
        card = await client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (MODEL, "model", "stepwise")
        assert card.max_model_len == engine.max_model_len
    for name in ("gpt-4", "org/other-model"):
        with pytest.raises(openai.NotFoundError) as e:
            await client.models.retrieve(name)
        assert e.value.body["code"] == "model_not_found"


async def test_n_choices(server):
    """n > 1 on the real model: greedy choices equal the n=1 text (the forked, copied partial
    block holds the right KV: the prompt's length is not a multiple of the block size), seeded
    choices differ, usage counts the prompt once."""
    engine, client = server
    prompt = "The three primary colors are"
    one = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert one.usage.prompt_tokens % engine.config.cache.block_size != 0
    two = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    three = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
                                            seed=11, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2] and len({c.text for c in three.choices}) == 3
