"""POST /v1/completions: `text_completion` objects, whole or streamed; `echo` and `logprobs`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web
from msgspec import UNSET

from engine import RequestOutput
from engine.admission import check_prompt_ids
from engine.chat_prompt import encode
from engine.errors import RequestError
from frontends.http.errors import ApiError, from_engine
from frontends.http.fields import check_refused
from frontends.http.generate import Job, ensure_ready, generate
from frontends.http.logprobs import completion_logprobs
from frontends.http.models import check_model
from frontends.http.protocol import Completion, CompletionChoice, CompletionRequest, Usage, decode
from frontends.http.state import STATE
from frontends.http.token_text import TokenText


@dataclass
class CompletionRenderer:
    id: str
    created: int
    model: str
    include_usage: bool
    tokens: TokenText | None = None  # for logprobs
    echo: str | None = None  # the prompt text, returned before the completion
    echo_only: bool = False  # max_tokens 0 with echo: the one token the engine generated is dropped
    _offset: int = 0  # text_offset of the next token: the tokens' texts so far (text held back for a stop string too)
    _echoed: bool = False

    def _object(self, choices: list[CompletionChoice], usage) -> Completion:
        return Completion(self.id, "text_completion", self.created, self.model, choices, usage)

    def _choice(self, out: RequestOutput, finish_reason: str | None) -> CompletionChoice:
        text = "" if self.echo_only else out.text
        entries = [] if self.echo_only else (out.logprobs or [])
        if self.echo is not None and not self._echoed:
            self._echoed = True
            text = self.echo + text
            entries = (out.prompt_logprobs or []) + entries
        logprobs = None
        if self.tokens is not None:
            logprobs = completion_logprobs(entries, self.tokens, self._offset)
            if logprobs.tokens:
                self._offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if self.echo_only and finish_reason is not None:
            finish_reason = "length"
        return CompletionChoice(0, text, logprobs, finish_reason)

    def opening(self) -> list[object]:
        return []

    def delta(self, out: RequestOutput) -> Completion | None:
        finish_reason = out.finish_reason if out.finished else None
        choice = self._choice(out, finish_reason)
        if not choice.text and finish_reason is None and not (choice.logprobs and choice.logprobs.tokens):
            return None
        return self._object([choice], None if self.include_usage else UNSET)

    def usage(self, usage: Usage) -> Usage:
        if not self.echo_only:
            return usage
        return Usage(usage.prompt_tokens, 0, usage.prompt_tokens, usage.prompt_tokens_details)

    def usage_chunk(self, usage: Usage) -> Completion:
        return self._object([], self.usage(usage))

    def whole(self, out: RequestOutput, usage: Usage) -> Completion:
        return self._object([self._choice(out, out.finish_reason)], self.usage(usage))


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await request.read()
    body = decode(raw, CompletionRequest)
    check_refused(raw, "completions")
    check_model(state, body.model)
    prompts = body.prompts()  # a list: one engine request per prompt, n choices each
    max_tokens = body.resolved_max_tokens()
    echo_only = body.echo and max_tokens == 0
    if echo_only:
        max_tokens = 1  # the engine generates at least one token: it is dropped (as vLLM does)
    params = body.sampling_params(max_tokens, logprobs=body.logprobs,
                                  prompt_logprobs=body.logprobs if body.echo else None)
    if body.echo and params.n > 1:
        raise ApiError(400, "echo is not supported with n > 1", param="echo")
    echoes: list[str | None] = [None] * len(prompts)
    if body.echo:
        ensure_ready(state, params)  # the tokenizer is there
        echoes = [p if isinstance(p, str) else _echo_text(state.engine.tokenizer, p) for p in prompts]
    response_id, created = state.new_id("cmpl"), state.clock()
    tokens = state.token_text if body.logprobs is not None else None

    def make(choice: int) -> CompletionRenderer:  # choice = prompt index x n + the prompt's choice
        return CompletionRenderer(response_id, created, state.model_name, body.include_usage, tokens,
                                  echoes[choice // params.n], echo_only)

    if body.add_special_tokens is False:  # the engine encodes text with them: encoded here, without
        ensure_ready(state, params)
        prompts = await _without_special_tokens(state.engine.tokenizer, prompts)
    jobs = [Job(p, None, params, body.stream, body.include_usage) for p in prompts]
    return await generate(request, state, jobs, make)


async def _without_special_tokens(tokenizer, prompts: list[str | list[int]]) -> list[str | list[int]]:
    """Text prompts as token ids without the tokenizer's special tokens (on a worker thread)."""
    def run() -> list[str | list[int]]:
        return [encode(tokenizer, p, chat=False, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]

    return await asyncio.to_thread(run)


def _echo_text(tokenizer, ids: list[int]) -> str:
    """The echoed prompt's text; ids the engine would refuse are refused first, as it would
    (decoding them would fail, e.g. OverflowError for a negative id)."""
    try:
        check_prompt_ids(ids, len(tokenizer))
    except RequestError as e:
        raise from_engine(e) from None
    return tokenizer.decode(ids)
