"""A request's prompt as the model sees it. Chat: the messages checked, then rendered through
the model's chat template. The engine's intake, the HTTP frontend (which measures a chat
prompt to size its default max_tokens, then submits the token ids) and the cluster's ingress
all render it here. `tools` (OpenAI's tool definitions) go to the template, which shows them
to the model in its own format. A template that has no place for them (SmolLM2's renders only
role and content) would drop them without a word, so the model would answer blind: the tools
are then described in the system message in the Hermes format that tool_choice "auto" parses,
and an assistant turn's earlier `tool_calls` are written into its content the same way.

Encoding (`encode`): text of a completion gets the tokenizer's own special tokens (the BOS a
Llama 3 or Gemma tokenizer adds; SmolLM2's adds none), as vLLM's completions and llama.cpp
do: Gemma 3 without its BOS answered "The capital of France is" with " France. The The The".
A rendered chat prompt already holds them (the template writes the BOS): none are added."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Executor

from engine.errors import RequestError

LONG_PROMPT_CHARS = 2000  # text longer than this is encoded off the event loop (intake, the cluster's ingress)


def encode(tokenizer, text: str, chat: bool, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids of a prompt's text: by default a completion's with the tokenizer's special
    tokens, a rendered chat prompt's without (its template wrote them); `add_special_tokens`
    (a request's own, as vLLM's) says otherwise."""
    return tokenizer.encode(text, add_special_tokens=not chat if add_special_tokens is None else add_special_tokens)


async def prompt_ids(tokenizer, prompt: str | list[int] | None, messages: list[dict] | None,
                     executor: Executor | None = None) -> list[int]:
    """A request's prompt as token ids: a chat rendered and encoded, text encoded, ids taken as
    they are (their range is intake's to check). Long text is encoded on `executor` (None:
    asyncio's default), off the event loop."""
    if (prompt is None) == (messages is None):
        raise RequestError("give exactly one of prompt and messages", "prompt")
    if messages is not None:
        text = chat_prompt(tokenizer, messages)
    elif isinstance(prompt, list):
        return list(prompt)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise RequestError("prompt must be a string or a list of token ids", "prompt")
    chat = messages is not None
    if len(text) <= LONG_PROMPT_CHARS:
        return encode(tokenizer, text, chat)
    return await asyncio.get_running_loop().run_in_executor(executor, encode, tokenizer, text, chat)


def chat_prompt(tokenizer, messages: object, tools: list[dict] | None = None) -> str:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise RequestError("messages must be a list of {role: str, content: str}", "messages")
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template (a pretrained, not instruction-tuned, model): "
                           "send a prompt to /v1/completions instead", "messages")
    template = tokenizer.chat_template  # a str, or a dict of named templates
    messages = _known_roles(" ".join(template.values()) if isinstance(template, dict) else str(template), messages)
    if any(m.get("tool_calls") for m in messages) and _render(tokenizer, messages) == _render(
            tokenizer, [_without_calls(m) for m in messages]):
        messages = [_calls_in_content(m) for m in messages]  # the template drops them
    if tools:
        shown = _render(tokenizer, messages, tools)
        if shown != _render(tokenizer, messages):
            return shown
        messages = _tools_in_system(messages, tools)  # the template ignores them
    return _render(tokenizer, messages)


OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _known_roles(template: str, messages: list[dict]) -> list[dict]:
    """OpenAI's roles, or one the template names (Llama 3.1's "ipython"); anything else is
    refused, as OpenAI refuses it (a template that prints any role would show the model a
    "wizard" turn it was never trained on). "developer", OpenAI's newer name for the system
    turn, is rendered as "system" where the template does not name it, as llama.cpp does
    (SmolLM2's printed a developer turn and then added its default system prompt before it)."""
    out = []
    for m in messages:
        role = m["role"]
        named = _names(template, role)
        if role not in OPENAI_ROLES and not named:
            raise RequestError(f"message role {role!r} is not one of {', '.join(OPENAI_ROLES)}, nor a role this "
                               "model's chat template names", "messages")
        out.append({**m, "role": "system"} if role == "developer" and not named else m)
    return out


def _names(template: str, role: str) -> bool:
    """Whether the template compares a value with `role` (`== 'ipython'`, `in ['user', 'ipython']`):
    a quoted word alone may be a key (`message['content']`)."""
    quoted = f"(?:'{re.escape(role)}'|\"{re.escape(role)}\")"
    return re.search(rf"[!=]=\s*{quoted}|{quoted}\s*[!=]=|\bin\s*[\[(][^\])]*{quoted}", template) is not None


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the model's template refused these messages (e.g. a role it lacks)
        raise RequestError(f"messages do not fit the chat template: {e}", "messages") from None


TOOLS_PREAMBLE = (
    "You can call functions to help answer. Their signatures, one JSON object each, are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def _tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def _without_calls(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _calls_in_content(message: dict) -> dict:
    """An assistant turn's calls as the Hermes blocks a model would have written for them."""
    if not message.get("tool_calls"):
        return message
    blocks = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RequestError("an assistant message's tool_calls must each have a function", "messages")
        call_json = json.dumps({"name": function.get("name"), "arguments": function.get("arguments", {})},
                               ensure_ascii=False)
        blocks.append(f"<tool_call>\n{call_json}\n</tool_call>")
    content = "\n".join([message["content"], *blocks] if message["content"] else blocks)
    return {**_without_calls(message), "content": content}
