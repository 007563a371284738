"""POST /v1/chat/completions: `chat.completion` objects, or `chat.completion.chunk`s whose
first carries the assistant role.

Without max_tokens / max_completion_tokens the reply may run to the end of the context
(as the OpenAI API does): the prompt is then rendered and tokenized here, once, on a worker
thread, and submitted as token ids.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
from aiohttp import web
from msgspec import UNSET

from engine import RequestOutput
from engine.chat_prompt import chat_prompt, encode
from engine.errors import RequestError
from frontends.http.chat_tools import ForcedCalls, HermesCalls
from frontends.http.errors import ApiError, from_engine
from frontends.http.fields import check_refused
from frontends.http.generate import Job, ensure_ready, generate
from frontends.http.logprobs import chat_logprobs
from frontends.http.models import check_model
from frontends.http.protocol import (
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatLogprobs, ChatRequest, Delta, Usage,
    decode,
)
from frontends.http.state import STATE, ServerState
from frontends.http.tool_choice import plan_tools
from frontends.http.token_text import TokenText


@dataclass
class ChatRenderer:
    id: str
    created: int
    model: str
    include_usage: bool
    tokens: TokenText | None = None  # set when logprobs are asked for

    def _chunk(self, choices: list[ChatChunkChoice], usage) -> ChatChunk:
        return ChatChunk(self.id, "chat.completion.chunk", self.created, self.model, choices, usage)

    def _no_usage(self):
        return None if self.include_usage else UNSET

    def _logprobs(self, out: RequestOutput) -> ChatLogprobs | None:
        return None if self.tokens is None else chat_logprobs(out.logprobs or [], self.tokens)

    def opening(self) -> list[object]:
        return [self._chunk([ChatChunkChoice(0, Delta(role="assistant", content=""))], self._no_usage())]

    def delta(self, out: RequestOutput) -> ChatChunk | None:
        if not (out.text or out.finished or out.logprobs):
            return None
        delta = Delta(content=out.text) if out.text else Delta()
        choice = ChatChunkChoice(0, delta, self._logprobs(out), out.finish_reason if out.finished else None)
        return self._chunk([choice], self._no_usage())

    def usage_chunk(self, usage: Usage) -> ChatChunk:
        return self._chunk([], usage)

    def whole(self, out: RequestOutput, usage: Usage) -> ChatCompletion:
        choice = ChatChoice(0, AssistantMessage("assistant", out.text), self._logprobs(out), out.finish_reason)
        return ChatCompletion(self.id, "chat.completion", self.created, self.model, [choice], usage)


async def prompt_ids(state: ServerState, messages: list[dict], tools: list[dict] | None = None,
                     add_special_tokens: bool | None = None) -> list[int]:
    """The chat prompt's token ids, rendered and tokenized on a worker thread."""
    tokenizer = state.engine.tokenizer

    def tokenize() -> list[int]:
        return encode(tokenizer, chat_prompt(tokenizer, messages, tools), True, add_special_tokens)

    try:
        return await asyncio.to_thread(tokenize)
    except RequestError as e:
        raise from_engine(e) from None


def default_max_tokens(state: ServerState, num_prompt_tokens: int) -> int:
    """Room left in the context (and the KV pool) after the prompt. Messages that leave none
    are refused here: the engine's error would count a completion the client never asked for."""
    engine, cache = state.engine, state.engine.config.cache
    pool = cache.num_blocks * cache.block_size
    room = min(engine.max_model_len, pool)
    if num_prompt_tokens >= room:
        limit = (f"This model's maximum context length is {room} tokens" if room == engine.max_model_len else
                 f"The KV cache holds {room} tokens")
        raise ApiError(400, f"{limit}. However, your messages resulted in {num_prompt_tokens} tokens, which leaves "
                            "no room for a completion. Please reduce the length of the messages.",
                       param="messages", code="context_length_exceeded")
    return room - num_prompt_tokens


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await request.read()
    body = decode(raw, ChatRequest)
    try:
        return await _complete(request, state, raw, body)
    except ApiError as e:  # the engine knows the length as max_tokens and the input as prompt: name them as sent
        e = e.naming("max_tokens", body.max_tokens_field())
        raise (e.naming("prompt", "messages") if e.code == "context_length_exceeded" else e) from None


async def _complete(request: web.Request, state: ServerState, raw: bytes, body: ChatRequest) -> web.StreamResponse:
    check_refused(raw, "chat")
    check_model(state, body.model)
    logprobs = body.resolved_logprobs()
    messages: list[dict] | None = [m.as_dict() for m in body.messages]
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    prompt, max_tokens = None, body.explicit_max_tokens()
    if max_tokens is None or tools.tools or body.add_special_tokens:
        # tokenized once, here: it sizes max_tokens, the template shows the model its tools, or
        # the tokenizer's special tokens are added to what the template wrote
        ensure_ready(state)
        prompt, messages = await prompt_ids(state, messages, tools.tools, body.add_special_tokens), None
        max_tokens = default_max_tokens(state, len(prompt)) if max_tokens is None else max_tokens
    params = body.sampling_params(max_tokens, logprobs=logprobs)
    if tools.structured_output is not None:
        if params.structured_output is not None:
            raise ApiError(400, "tool_choice forces a tool call; it cannot be combined with a JSON response_format",
                           param="tool_choice")
        params = msgspec.structs.replace(params, structured_output=tools.structured_output)
    if tools.mode in ("forced", "auto") and logprobs is not None:
        raise ApiError(400, "logprobs are not supported together with tools (tool_choice other than 'none')",
                       param="logprobs")
    base = ChatRenderer(state.new_id("chatcmpl"), state.clock(), state.model_name, body.include_usage,
                        state.token_text if logprobs is not None else None)

    def make(choice: int):  # one renderer per choice: the tool-call ones keep per-choice state
        if tools.mode == "forced":
            return ForcedCalls(base)
        if tools.mode == "auto":
            return HermesCalls(base, tools.declared)
        return base

    return await generate(request, state, [Job(prompt, messages, params, body.stream, body.include_usage)], make)
