"""POST /v1/completions: `text_completion` objects, whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from msgspec import UNSET

from frontends.http.generate import Job, generate
from frontends.http.models import check_model
from frontends.http.protocol import Completion, CompletionChoice, CompletionRequest, Usage, decode
from frontends.http.state import STATE


@dataclass
class CompletionRenderer:
    id: str
    created: int
    model: str
    include_usage: bool

    def _object(self, choices: list[CompletionChoice], usage) -> Completion:
        return Completion(self.id, "text_completion", self.created, self.model, choices, usage)

    def opening(self, n: int) -> list[object]:
        return []

    def delta(self, index: int, text: str, finish_reason: str | None) -> Completion:
        return self._object([CompletionChoice(index, text, None, finish_reason)], None if self.include_usage else UNSET)

    def usage_chunk(self, usage: Usage) -> Completion:
        return self._object([], usage)

    def whole(self, choices: list[tuple[str, str]], usage: Usage) -> Completion:
        return self._object([CompletionChoice(i, text, None, reason) for i, (text, reason) in enumerate(choices)],
                            usage)


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode(await request.read(), CompletionRequest)
    check_model(state, body.model)
    params = body.sampling_params(body.resolved_max_tokens())
    render = CompletionRenderer(state.new_id("cmpl"), state.clock(), state.model_name, body.include_usage)
    return await generate(request, state, Job(body.prompt, None, params, body.stream, body.include_usage), render)
