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
from engine.chat_prompt import prompt_ids

MESSAGES = [{"role": "user", "content": "hi"}]


def test_messages_render_through_the_template():
    assert "hi" in chat_prompt(tiny_tokenizer(), MESSAGES)


def test_a_model_without_a_chat_template_points_to_completions():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = None
    with pytest.raises(RequestError, match="no chat template .* /v1/completions") as e:
        chat_prompt(tok, MESSAGES)
    assert e.value.param == "messages"


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_tools_a_template_ignores_are_described_in_the_system_message():
    """The tiny template (as SmolLM2's) renders role and content only: the tools used to vanish,
    so the model answered without knowing them."""
    tok = tiny_tokenizer()
    prompt = chat_prompt(tok, MESSAGES, [TOOL])
    assert prompt.startswith("<|im_start|>system\n") and "<tools>" in prompt and '"get_weather"' in prompt
    assert '"Weather in a city"' in prompt and "<tool_call>" in prompt  # the format "auto" parses
    assert prompt.endswith(chat_prompt(tok, MESSAGES))  # then the conversation as before
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    with_system = chat_prompt(tok, system, [TOOL])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n") and with_system.count("<|im_start|>system") == 1


def test_tools_a_template_renders_are_left_to_it():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}" + tok.chat_template
    prompt = chat_prompt(tok, MESSAGES, [TOOL])
    assert prompt.startswith("TOOLS:") and "<tools>" not in prompt


def test_earlier_calls_a_template_drops_are_written_in_their_turn():
    """An assistant turn of calls rendered as an empty turn: a history that called with Paris and
    one that called with Berlin gave the model the same prompt."""
    prompt = chat_prompt(tiny_tokenizer(), CALLED)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.index("<tool_call>") < prompt.index("sunny")
    tok = copy.deepcopy(tiny_tokenizer())  # a template that renders calls itself keeps its own form
    tok.chat_template = tok.chat_template.replace("{{ m['content'] }}", "{{ m['content'] }}{{ m.get('tool_calls', '') }}")
    assert "<tool_call>" not in chat_prompt(tok, CALLED) and "Paris" in chat_prompt(tok, CALLED)


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


def test_roles_are_openai_s_or_the_template_s():
    """Any role was printed as it came ("wizard"); "developer" rendered as a developer turn, and
    SmolLM2's template then added its default system prompt in front of it."""
    tok = copy.deepcopy(tiny_tokenizer())
    with pytest.raises(RequestError, match="message role 'wizard' is not one of system, developer") as e:
        chat_prompt(tok, [{"role": "wizard", "content": "hi"}])
    assert e.value.param == "messages"
    as_system = chat_prompt(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat_prompt(tok, [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]) == as_system
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'ipython' or m['role'] == 'developer' %}[{{ m['role'] }}]"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    assert chat_prompt(tok, [{"role": "ipython", "content": "42"}]) == "[ipython]42"  # a role it names
    assert chat_prompt(tok, [{"role": "developer", "content": "x"}]) == "[developer]x"  # kept where named
    for key in ("content", "role"):  # quoted in every template, as keys: not roles it names
        with pytest.raises(RequestError, match=f"message role '{key}' is not one of"):
            chat_prompt(tok, [{"role": key, "content": "x"}])
    tok.chat_template = {"default": "{% for m in messages %}{% if m.role in ['user', \"ipython\"] %}+{% endif %}"
                                    "{{ m['content'] }}{% endfor %}"}  # named templates, one with both quotes
    assert chat_prompt(tok, [{"role": "ipython", "content": "42"}]) == "+42"
