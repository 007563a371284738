"""`n` > 1 and a completions `prompt` list through the official `openai` client on the tiny
model: n choices with their `index`, distinct when seeded; streamed chunks interleave the
choices (each chunk one choice, its own finish_reason) and reassemble to the whole response;
usage counts each prompt once and sums the completions; n with structured output, logprobs
and forced tool calls (each choice its own grammar state); one choice per listed prompt;
`best_of`, a bad `n` and `echo` with n > 1 are refused naming the field."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.frontends.conftest import openai_serving, tiny_config
from tests.frontends.test_tools import TOOLS, check_calls

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
MAX_TOKENS = 10
PROMPT = [5, 17, 99, 42, 7, 250, 31, 64, 8, 11, 120]  # token ids: the tiny tokenizer's text is noise
PROMPT2 = [9, 8, 7, 200, 100, 3]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tiny_model):
    async with openai_serving(tiny_model, tiny_config(policy="continuous"), timeout=60) as pair:
        yield pair


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
    usage = chunks[-1].usage  # the same but for cached_tokens: the second request hits the prefix cache
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
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


async def test_a_prompt_list_gives_n_choices_per_prompt(server):
    _, client = server
    greedy = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    singles = [(await client.completions.create(prompt=p, **greedy)).choices[0].text for p in (PROMPT, PROMPT2)]
    whole = await client.completions.create(prompt=[PROMPT, PROMPT2], n=2, **greedy)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]  # prompt by prompt, n each (as vLLM numbers them)
    assert [c.text for c in whole.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert whole.usage.prompt_tokens == len(PROMPT) + len(PROMPT2)
    assert whole.usage.completion_tokens == 4 * MAX_TOKENS
    chunks = [c async for c in await client.completions.create(
        prompt=[PROMPT, PROMPT2], n=2, stream=True, stream_options={"include_usage": True}, **greedy)]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    texts = await client.completions.create(prompt=["hello there", "a b c"], **greedy)
    assert [c.index for c in texts.choices] == [0, 1]


async def test_a_refused_prompt_in_a_list_fails_the_whole_request(server):
    engine, client = server
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=[PROMPT, [1] * 100_000], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=[PROMPT, "text"], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    for _ in range(100):  # the first prompt, already submitted, was aborted: nothing is left behind
        snap = engine.snapshot()
        if not snap.running and not snap.waiting and snap.num_free_blocks == snap.num_blocks:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"requests left behind: {engine.snapshot()}")


SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b", "c"]}, "v": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["k", "v"], "additionalProperties": False}


async def test_each_choice_keeps_its_own_grammar(server):
    _, client = server
    fmt = {"type": "json_schema", "json_schema": {"name": "kv", "schema": SCHEMA}}
    out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON"}], n=3,
                                               max_tokens=60, temperature=1.0, seed=3, response_format=fmt)
    values = [json.loads(c.message.content) for c in out.choices]
    for v in values:
        jsonschema.validate(v, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 1, values  # sampled apart, each still valid


async def test_each_choice_has_its_own_logprobs(server):
    _, client = server
    out = await client.completions.create(prompt=PROMPT, n=2, logprobs=3, **sampled())
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == MAX_TOKENS  # (the tiny model's tokens are byte noise)
    assert out.choices[0].logprobs.tokens != out.choices[1].logprobs.tokens
    chat = await client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True,
                                                top_logprobs=3, **sampled())
    for choice in chat.choices:
        entries = choice.logprobs.content
        assert len(entries) == MAX_TOKENS
        for e in entries:  # sorted, and the chosen token no likelier than the top one
            ranked = [t.logprob for t in e.top_logprobs]
            assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True)
            assert e.logprob <= ranked[0] + 1e-6


async def test_each_choice_makes_its_own_forced_tool_call(server):
    _, client = server
    # a named function with integer arguments: the random model's odd bytes (README, known gaps)
    # cannot reach a length-bounded string here, so a failure can only be a choice's grammar state
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "add?"}], tools=TOOLS, n=3,
                  tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=300, temperature=1.0,
                  seed=5)
    whole = await client.chat.completions.create(**kwargs)
    calls = [check_calls(c.message.tool_calls) for c in whole.choices]
    assert all(c.finish_reason == "tool_calls" for c in whole.choices)
    assert len({json.dumps(c) for c in calls}) > 1, calls  # sampled apart
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    for i, expected in enumerate(calls):
        parts: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.index != i:
                    continue
                for d in choice.delta.tool_calls or []:
                    if d.function.name:
                        names[d.index] = d.function.name
                    parts.setdefault(d.index, []).append(d.function.arguments or "")
        assert [(names[k], "".join(parts[k])) for k in sorted(parts)] == expected


async def test_echo_with_n_is_refused(server):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, echo=True)
    assert e.value.body["param"] == "echo"
