"""A request's prompt as the model sees it. Chat: the messages checked, then rendered through
the model's chat template. The engine's intake, the HTTP frontend (which measures a chat
prompt to size its default max_tokens, then submits the token ids) and the cluster's ingress
all render it here. `tools` (OpenAI's tool definitions) go to the template, which shows them
to the model in its own format.

Encoding (`encode`): text of a completion gets the tokenizer's own special tokens (the BOS a
Llama 3 or Gemma tokenizer adds; SmolLM2's adds none), as vLLM's completions and llama.cpp
do: Gemma 3 without its BOS answered "The capital of France is" with " France. The The The".
A rendered chat prompt already holds them (the template writes the BOS): none are added."""

from __future__ import annotations

from engine.errors import RequestError

LONG_PROMPT_CHARS = 2000  # text longer than this is encoded off the event loop (intake, the cluster's ingress)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt's text: a completion's with the tokenizer's special tokens, a
    rendered chat prompt's without (its template wrote them)."""
    return tokenizer.encode(text, add_special_tokens=not chat)


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
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the model's template refused these messages (e.g. a role it lacks)
        raise RequestError(f"messages do not fit the chat template: {e}", "messages") from None
