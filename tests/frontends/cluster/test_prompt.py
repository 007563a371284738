"""The ingress tokenizes with the engine intake's function (engine/chat_prompt.py): the same
ids for the prompt (a chat through the chat template), the same refusals with the same field
named. Runs without Ray."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from engine.errors import RequestError
from engine.chat_prompt import LONG_PROMPT_CHARS, prompt_ids
from tests.frontends.conftest import tiny_config

CASES = [
    ("Hello there", None),
    ("x" * (LONG_PROMPT_CHARS + 10), None),  # the worker-thread path
    ([5, 6, 7, 8], None),
    (None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi ✓"}]),
]
BAD = [
    (None, None),
    ("a", [{"role": "user", "content": "b"}]),
    (None, []),
    (None, [{"role": "user"}]),
    (None, "not a list"),
    (3.5, None),
]


async def test_same_ids_and_refusals_as_the_engine(tiny_model):
    tokenizer = tiny_model.tokenizer
    async with Engine(tiny_config(attention_backend="torch"), loaded=tiny_model) as engine:
        for prompt, messages in CASES:
            ids = await prompt_ids(tokenizer, prompt, messages)
            outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=1), messages=messages)]
            by_ids = [o async for o in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))]
            assert outs[-1].num_prompt_tokens == len(ids) == by_ids[-1].num_prompt_tokens
        for prompt, messages in BAD:
            with pytest.raises(RequestError) as ours:
                await prompt_ids(tokenizer, prompt, messages)
            with pytest.raises(RequestError) as theirs:
                await engine.submit(prompt, SamplingParams(), messages=messages)
            assert (str(ours.value), ours.value.param) == (str(theirs.value), theirs.value.param)


async def test_chat_ids_are_the_template_text_encoded():
    from engine.model.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert await prompt_ids(tokenizer, None, messages) == tokenizer.encode(text, add_special_tokens=False)
