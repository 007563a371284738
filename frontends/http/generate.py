"""The path every generation takes: submit to the engine, then relay its outputs either as
one JSON body or as SSE chunks. The endpoint supplies a `Renderer` for its object shapes.

Leaving early always aborts the engine request at once: the handler runs with aiohttp's
handler cancellation, so a client that disconnects (mid-stream, or during prefill before
anything was written) cancels it; the cancellation lands in `engine.stream`, whose cleanup
aborts the request. A cancellation during `submit` aborts the request as soon as intake
accepts it (`Engine.submit`).

A stream's status line and SSE headers go out as soon as the engine accepted the request,
before the first token (clients and proxies see the stream open during a long prefill); a
failure after that is an SSE error event. Writing them is the one await between submit and
the first iteration of `engine.stream`: a cancellation there aborts the request itself.
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
from engine.output_buffer import merge
from frontends.http import sse
from frontends.http.errors import ApiError, from_engine, shutting_down
from frontends.http.protocol import PromptTokensDetails, Usage
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

    def opening(self) -> list[object]:
        """Chunks sent before the first delta (chat: the assistant role)."""
        ...

    def delta(self, out: RequestOutput) -> object | list[object] | None:
        """The chunk(s) for one output (its text, logprobs, and finish reason when final); None
        or []: nothing to send (tool-call renderers may send several chunks, or hold text back)."""
        ...

    def usage_chunk(self, usage: Usage) -> object: ...

    def whole(self, out: RequestOutput, usage: Usage) -> object:
        """The response body; `out`: every output of the request merged into one."""
        ...


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
                return await _relay(request, state, outputs, render, job.include_usage)
            return await _collect(state, outputs, render)


def usage_of(out: RequestOutput) -> Usage:
    return Usage(out.num_prompt_tokens, out.num_generated_tokens, out.num_prompt_tokens + out.num_generated_tokens,
                 PromptTokensDetails(out.num_cached_tokens))


def ended_early(state: ServerState, out: RequestOutput) -> ApiError:
    """A final output that is not a completion: the engine failed it, or shutdown aborted it."""
    if state.live.closing:
        return shutting_down()
    if out.finish_reason == "abort":
        return ApiError(503, "the request was aborted", code="aborted")
    return ApiError(500, f"generation failed: {out.error}", code="engine_error")


async def _collect(state: ServerState, outputs: AsyncIterator[RequestOutput], render: Renderer) -> web.Response:
    whole: RequestOutput | None = None
    async for out in outputs:
        whole = out if whole is None else merge(whole, out)
        if out.finished:
            if out.finish_reason in ("abort", "error"):
                raise ended_early(state, out)
            body = render.whole(whole, usage_of(out))
            return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                                headers={"X-Request-Id": render.id})
    raise ApiError(500, "the engine ended the request without a final output", code="engine_error")


async def _relay(request: web.Request, state: ServerState, outputs: AsyncIterator[RequestOutput], render: Renderer,
                 include_usage: bool) -> web.StreamResponse:
    try:
        response = await sse.open_stream(request, {"X-Request-Id": render.id})
        for chunk in render.opening():
            await response.write(sse.frame(chunk))
    except BaseException:  # the client left (or a write failed) before `outputs` ever started
        await state.engine.abort(render.id)
        raise
    try:
        async for out in outputs:
            failed = out.finished and out.finish_reason in ("abort", "error")
            if failed:
                await response.write(sse.frame(ended_early(state, out).body()))
                break
            chunks = render.delta(out)
            for chunk in chunks if isinstance(chunks, list) else [] if chunks is None else [chunks]:
                await response.write(sse.frame(chunk))
            if out.finished and include_usage:
                await response.write(sse.frame(render.usage_chunk(usage_of(out))))
        await response.write(sse.DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client left while we wrote: the stream's cleanup aborts
        pass
    return response
