"""POST /v1/chat/completions: `chat.completion` objects, or `chat.completion.chunk`s whose
first carries the assistant role.

Without max_tokens / max_completion_tokens the reply may run to the end of the context
(as the OpenAI API does): the prompt is measured once here, on a worker thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web
from msgspec import UNSET

from frontends.http.generate import Job, ensure_ready, generate, validated
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

    def opening(self) -> list[object]:
        return [self._chunk([ChatChunkChoice(0, Delta(role="assistant", content=""))], self._no_usage())]

    def delta(self, text: str, finish_reason: str | None) -> ChatChunk:
        delta = Delta(content=text) if text else Delta()
        return self._chunk([ChatChunkChoice(0, delta, None, finish_reason)], self._no_usage())

    def usage_chunk(self, usage: Usage) -> ChatChunk:
        return self._chunk([], usage)

    def whole(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletion:
        choice = ChatChoice(0, AssistantMessage("assistant", text), None, finish_reason)
        return ChatCompletion(self.id, "chat.completion", self.created, self.model, [choice], usage)


async def default_max_tokens(state: ServerState, messages: list[dict]) -> int:
    """Room left in the context (and the KV pool) after the prompt; at least 1, so an
    over-long prompt still reaches the engine and gets its context-length error."""
    engine, cache = state.engine, state.engine.config.cache
    tokenizer = engine.tokenizer

    def count() -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    try:
        n = await asyncio.to_thread(count)
    except Exception:  # malformed messages: the engine refuses them with the right field
        return 1
    return max(1, min(engine.max_model_len, cache.num_blocks * cache.block_size) - n)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode(await request.read(), ChatRequest)
    check_model(state, body.model)
    messages = [m.as_dict() for m in body.messages]
    max_tokens = body.explicit_max_tokens()
    if max_tokens is None:
        ensure_ready(state)
        max_tokens = await default_max_tokens(state, messages)
    params = validated(body.sampling_params(max_tokens))
    render = ChatRenderer(state.new_id("chatcmpl"), state.clock(), state.model_name, body.include_usage)
    return await generate(request, state, Job(None, messages, params, body.stream, body.include_usage), render)
