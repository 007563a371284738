"""A chat request's prompt: rendered through the model's template; a model without one (a
pretrained, not instruction-tuned, model such as gemma3-270m) refuses chat by name."""

from __future__ import annotations

import copy

import pytest

from engine.chat_prompt import chat_prompt
from engine.errors import RequestError
from engine.model.tiny import tiny_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def test_messages_render_through_the_template():
    assert "hi" in chat_prompt(tiny_tokenizer(), MESSAGES)


def test_a_model_without_a_chat_template_points_to_completions():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = None
    with pytest.raises(RequestError, match="no chat template .* /v1/completions") as e:
        chat_prompt(tok, MESSAGES)
    assert e.value.param == "messages"


@pytest.mark.parametrize("messages,match", [("hi", "must be a list"), ([], "must not be empty"),
                                            ([{"role": "user"}], "must be a list")])
def test_malformed_messages_are_named(messages, match):
    with pytest.raises(RequestError, match=match):
        chat_prompt(tiny_tokenizer(), messages)
