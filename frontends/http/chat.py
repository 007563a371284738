"""POST /v1/chat/completions: `chat.completion` objects, or `chat.completion.chunk`s whose
first carries the assistant role.

Without max_tokens / max_completion_tokens the reply may run to the end of the context
(as the OpenAI API does): the prompt is then rendered and tokenized here, once, on a worker
thread, and submitted as token ids.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web
from msgspec import UNSET

from engine.chat_prompt import chat_prompt
from engine.errors import RequestError
from frontends.http.errors import from_engine
from frontends.http.generate import Job, ensure_ready, generate
from frontends.http.models import check_model
from frontends.http.protocol import (
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatRequest, Delta, Usage, decode,
)
from frontends.http.state import STATE, ServerState


@dataclass
class ChatRenderer:
    id: str
    created: int
    model: str
    include_usage: bool

    def _chunk(self, choices: list[ChatChunkChoice], usage) -> ChatChunk:
        return ChatChunk(self.id, "chat.completion.chunk", self.created, self.model, choices, usage)

    def _no_usage(self):
        return None if self.include_usage else UNSET

    def opening(self, n: int) -> list[object]:
        return [self._chunk([ChatChunkChoice(i, Delta(role="assistant", content=""))], self._no_usage())
                for i in range(n)]

    def delta(self, index: int, text: str, finish_reason: str | None) -> ChatChunk:
        delta = Delta(content=text) if text else Delta()
        return self._chunk([ChatChunkChoice(index, delta, None, finish_reason)], self._no_usage())

    def usage_chunk(self, usage: Usage) -> ChatChunk:
        return self._chunk([], usage)

    def whole(self, choices: list[tuple[str, str]], usage: Usage) -> ChatCompletion:
        body = [ChatChoice(i, AssistantMessage("assistant", text), None, reason) for i, (text, reason) in enumerate(choices)]
        return ChatCompletion(self.id, "chat.completion", self.created, self.model, body, usage)


async def prompt_ids(state: ServerState, messages: list[dict]) -> list[int]:
    """The chat prompt's token ids, rendered and tokenized on a worker thread."""
    tokenizer = state.engine.tokenizer

    def tokenize() -> list[int]:
        return tokenizer.encode(chat_prompt(tokenizer, messages), add_special_tokens=False)

    try:
        return await asyncio.to_thread(tokenize)
    except RequestError as e:
        raise from_engine(e) from None


def default_max_tokens(state: ServerState, num_prompt_tokens: int) -> int:
    """Room left in the context (and the KV pool) after the prompt; at least 1, so an
    over-long prompt still reaches the engine and gets its context-length error."""
    engine, cache = state.engine, state.engine.config.cache
    return max(1, min(engine.max_model_len, cache.num_blocks * cache.block_size) - num_prompt_tokens)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode(await request.read(), ChatRequest)
    check_model(state, body.model)
    messages: list[dict] | None = [m.as_dict() for m in body.messages]
    prompt, max_tokens = None, body.explicit_max_tokens()
    if max_tokens is None:
        ensure_ready(state)
        prompt, messages = await prompt_ids(state, messages), None  # tokenized once, here: it sizes max_tokens
        max_tokens = default_max_tokens(state, len(prompt))
    params = body.sampling_params(max_tokens)
    render = ChatRenderer(state.new_id("chatcmpl"), state.clock(), state.model_name, body.include_usage)
    return await generate(request, state, Job(prompt, messages, params, body.stream, body.include_usage), render)
