"""Tokenize a request once, at the ingress, exactly as the engine's intake would.

The router needs the prompt's token ids to hash its KV blocks, and the replica then gets the
ids (not the text), so nothing is tokenized twice. The rules, and the errors for what they
refuse, are intake's: a chat goes through the model's chat template with the generation
prompt, text is encoded by chat_prompt.encode, a list of ids is taken as is (the replica's
intake still checks their range, the context length and the KV pool).
"""

from __future__ import annotations

import asyncio

from engine.chat_prompt import LONG_PROMPT_CHARS, chat_prompt, encode
from engine.errors import RequestError


def _text_of(tokenizer, prompt: str | list[int] | None, messages: list[dict] | None) -> str | list[int]:
    if (prompt is None) == (messages is None):
        raise RequestError("give exactly one of prompt and messages", "prompt")
    if messages is not None:
        return chat_prompt(tokenizer, messages)  # the same rendering and errors as intake
    if isinstance(prompt, list):
        return list(prompt)
    if isinstance(prompt, str):
        return prompt
    raise RequestError("prompt must be a string or a list of token ids", "prompt")


async def prompt_ids(tokenizer, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
    text = _text_of(tokenizer, prompt, messages)
    if isinstance(text, list):
        return text
    chat = messages is not None
    if len(text) <= LONG_PROMPT_CHARS:
        return encode(tokenizer, text, chat)
    return await asyncio.to_thread(encode, tokenizer, text, chat)
