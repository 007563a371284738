"""The path every generation takes: submit to the engine, then relay its outputs either as
one JSON body or as SSE chunks. The endpoint supplies a `Renderer` for its object shapes.

Leaving early always aborts the engine request at once: the handler runs with aiohttp's
handler cancellation, so a client that disconnects (mid-stream, or during prefill before
anything was written) cancels it; the cancellation lands in `engine.stream`, whose cleanup
aborts the request. A cancellation during `submit` aborts the request as soon as intake
accepts it (`Engine.submit`).

With n > 1 the engine's outputs of the choices interleave, each tagged with its `index`:
streamed, each becomes a chunk whose one choice has that index (and its own finish_reason);
whole, they are gathered per choice. Usage counts the prompt once and sums the choices'
completion tokens.

Headers go out with the first output (the first token). This keeps submit and the first
iteration of `engine.stream` back to back with no await in between, so there is no moment
where a request is accepted but nothing would clean it up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import msgspec
from aiohttp import web

from engine import EngineDeadError, QueueFullError, RequestError, RequestOutput, SamplingParams
from frontends.http import sse
from frontends.http.errors import ApiError, from_engine, shutting_down
from frontends.http.protocol import Usage
from frontends.http.state import ServerState


@dataclass(frozen=True)
class Job:
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    stream: bool
    include_usage: bool


class Renderer(Protocol):
    id: str

    def opening(self, n: int) -> list[object]:
        """Chunks sent before the first delta (chat: the assistant role of each of the n choices)."""
        ...

    def delta(self, index: int, text: str, finish_reason: str | None) -> object: ...

    def usage_chunk(self, usage: Usage) -> object: ...

    def whole(self, choices: list[tuple[str, str]], usage: Usage) -> object:
        """The response of all choices: (text, finish_reason) each, in index order."""
        ...


class Choices:
    """What the outputs of the n choices add up to: per choice, text and end; the usage."""

    def __init__(self, n: int):
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.num_generated = [0] * n
        self.num_prompt_tokens = 0

    def add(self, out: RequestOutput) -> None:
        self.texts[out.index].append(out.text)
        if out.finished:
            self.finish_reasons[out.index] = out.finish_reason
            self.num_generated[out.index] = out.num_generated_tokens
            self.num_prompt_tokens = out.num_prompt_tokens

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def whole(self) -> list[tuple[str, str]]:
        return [("".join(t), r or "") for t, r in zip(self.texts, self.finish_reasons)]

    def usage(self) -> Usage:
        completion = sum(self.num_generated)
        return Usage(self.num_prompt_tokens, completion, self.num_prompt_tokens + completion)


def ensure_ready(state: ServerState, params: SamplingParams | None = None) -> None:
    """Refuse with a 503 unless the engine takes requests. Bad `params` are a 400 even then:
    they are validated here only while the engine cannot take them (it validates them itself)."""
    engine = state.engine
    if params is not None and (state.live.closing or engine.dead or not engine.ready):
        try:
            params.validate()
        except RequestError as e:
            raise from_engine(e) from None
    if state.live.closing:
        raise shutting_down()
    if engine.dead:
        raise ApiError(503, f"engine unavailable: {engine.dead}", code="engine_unavailable")
    if not engine.ready:
        raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"Retry-After": "1"})


async def generate(request: web.Request, state: ServerState, job: Job, render: Renderer) -> web.StreamResponse:
    ensure_ready(state, job.params)
    engine, request_id = state.engine, render.id
    with state.live.track(request_id):
        try:
            await engine.submit(job.prompt, job.params, messages=job.messages, request_id=request_id)
        except asyncio.CancelledError:
            await engine.abort(request_id)
            raise
        except (RequestError, QueueFullError, EngineDeadError) as e:
            raise from_engine(e) from None
        async with aclosing(engine.stream(request_id)) as outputs:
            if job.stream:
                return await _relay(request, state, outputs, render, job.include_usage, job.params.n)
            return await _collect(state, outputs, render, job.params.n)


def ended_early(state: ServerState, out: RequestOutput) -> ApiError:
    """A final output that is not a completion: the engine failed it, or shutdown aborted it."""
    if state.live.closing:
        return shutting_down()
    if out.finish_reason == "abort":
        return ApiError(503, "the request was aborted", code="aborted")
    return ApiError(500, f"generation failed: {out.error}", code="engine_error")


async def _collect(state: ServerState, outputs: AsyncIterator[RequestOutput], render: Renderer,
                   n: int) -> web.Response:
    choices = Choices(n)
    async for out in outputs:
        if out.finished and out.finish_reason in ("abort", "error"):
            raise ended_early(state, out)
        choices.add(out)
    if not choices.done:
        raise ApiError(500, "the engine ended the request without a final output", code="engine_error")
    body = render.whole(choices.whole(), choices.usage())
    return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                        headers={"X-Request-Id": render.id})


async def _relay(request: web.Request, state: ServerState, outputs: AsyncIterator[RequestOutput], render: Renderer,
                 include_usage: bool, n: int) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    choices = Choices(n)
    try:
        async for out in outputs:
            failed = out.finished and out.finish_reason in ("abort", "error")
            if response is None:
                if failed:
                    raise ended_early(state, out)  # nothing sent yet: a plain HTTP error
                response = await sse.open_stream(request, {"X-Request-Id": render.id})
                for chunk in render.opening(n):
                    await response.write(sse.frame(chunk))
            if failed:
                await response.write(sse.frame(ended_early(state, out).body()))
                break
            if out.text or out.finished:
                reason = out.finish_reason if out.finished else None
                await response.write(sse.frame(render.delta(out.index, out.text, reason)))
            choices.add(out)
            if choices.done and include_usage:
                await response.write(sse.frame(render.usage_chunk(choices.usage())))
        if response is None:
            raise ApiError(500, "the engine ended the request without output", code="engine_error")
        await response.write(sse.DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client left while we wrote: the stream's cleanup aborts
        pass
    return response or web.Response(status=499)
