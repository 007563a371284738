"""A request's prompt: a chat rendered through the model's template (a model without one, a
pretrained model such as gemma3-270m, refuses chat by name); a completion's text encoded with
the tokenizer's own special tokens (its BOS), a rendered chat without (its template wrote them),
the same at the engine's intake and the cluster's ingress."""

from __future__ import annotations

import asyncio
import copy

import pytest
from tokenizers import processors

from engine.chat_prompt import chat_prompt, encode
from engine.errors import RequestError
from engine.model.tiny import tiny_tokenizer
from frontends.cluster.prompt import prompt_ids

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


def bos_tokenizer():
    """The tiny tokenizer, adding a BOS (id 0) as Llama 3's and Gemma's do."""
    tok = copy.deepcopy(tiny_tokenizer())
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                  special_tokens=[("<|endoftext|>", 0)])
    return tok


def test_a_completion_gets_the_tokenizers_bos_and_a_chat_only_its_templates():
    tok = bos_tokenizer()
    plain = tok.encode("hi", add_special_tokens=False)
    assert encode(tok, "hi", chat=False) == [0, *plain]
    text = chat_prompt(tok, MESSAGES)
    assert encode(tok, text, chat=True) == tok.encode(text, add_special_tokens=False)
    # the cluster's ingress tokenizes as intake does
    assert asyncio.run(prompt_ids(tok, "hi", None)) == [0, *plain]
    assert asyncio.run(prompt_ids(tok, None, MESSAGES)) == encode(tok, text, chat=True)
