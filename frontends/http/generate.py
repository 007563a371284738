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
the first iteration of the outputs: a cancellation there aborts the requests itself.

Several choices (`n > 1`, or a completions `prompt` that is a list: one engine request per
prompt) interleave: each output is rendered by its choice's own renderer and numbered
(frontends/http/choices.py); whole, the outputs are gathered per choice. Usage counts each
prompt once and sums the choices' completion tokens. One choice failing ends the response
(an error; streamed, an error event) and aborts the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import msgspec
from aiohttp import web

from engine import EngineDeadError, QueueFullError, RequestAbortedError, RequestError, RequestOutput, SamplingParams
from frontends.http import sse
from frontends.http.choices import Choices, ManyChoices
from frontends.http.errors import ApiError, from_engine, not_ready, shutting_down
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
    """One choice's object shapes (numbered 0; ManyChoices renumbers them)."""

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
        """The response body; `out`: every output of the choice merged into one."""
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
        raise not_ready(engine)


async def generate(request: web.Request, state: ServerState, jobs: list[Job],
                   make: Callable[[int], Renderer]) -> web.StreamResponse:
    """Run `jobs` (one per prompt, the same params) as one response; `make(choice)` renders a choice."""
    first = jobs[0]
    ensure_ready(state, first.params)
    try:
        first.params.validate()  # here too, as its n sizes the response (the engine validates on submit)
    except RequestError as e:
        raise from_engine(e) from None
    capacity = state.engine.queue_capacity
    if len(jobs) > capacity:  # could never be in the queue at once: a 503 "retry later" would never pass
        raise ApiError(400, f"a batch of {len(jobs)} prompts is more than the waiting queue holds ({capacity}: "
                       f"[scheduler] max_waiting); send at most {capacity} per request", param="prompt")
    n = first.params.n
    render = ManyChoices(make, len(jobs) * n)
    ids = [render.id] if len(jobs) == 1 else [f"{render.id}-{i}" for i in range(len(jobs))]
    with state.live.track(*ids):
        await _submit(state, jobs, ids)
        async with aclosing(_outputs(state, ids, n)) as outputs:
            if first.stream:
                return await _relay(request, state, outputs, render, first.include_usage, n, ids)
            return await _collect(state, outputs, render, n)


async def _submit(state: ServerState, jobs: list[Job], ids: list[str]) -> None:
    """Submit every job, or none: a refusal or a cancellation aborts those already in."""
    engine = state.engine
    for k, (job, request_id) in enumerate(zip(jobs, ids)):
        try:
            await engine.submit(job.prompt, job.params, messages=job.messages, request_id=request_id)
        except asyncio.CancelledError:
            await _abort(state, ids[: k + 1])
            raise
        except (RequestError, QueueFullError, EngineDeadError) as e:
            await _abort(state, ids[:k])
            if isinstance(e, EngineDeadError) and not engine.dead and not engine.ready:  # a cluster's replicas
                raise not_ready(engine) from None  # all just failed: for now, as the next request is told
            raise from_engine(e) from None
        except RequestAbortedError:  # aborted while its grammar compiled: shutdown's abort
            await _abort(state, ids[:k])
            raise aborted(state) from None


async def _abort(state: ServerState, ids: list[str]) -> None:
    for request_id in ids:
        await state.engine.abort(request_id)


async def _outputs(state: ServerState, ids: list[str], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice, output) of every request in `ids` as they come; closing it aborts what still runs."""
    engine = state.engine
    if len(ids) == 1:
        async with aclosing(engine.stream(ids[0])) as outputs:
            async for out in outputs:
                yield out.index, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, request_id: str) -> None:
        try:
            async with aclosing(engine.stream(request_id)) as outputs:
                async for out in outputs:
                    queue.put_nowait((p * n + out.index, out))
        except Exception as e:  # e.g. the engine died: the consumer raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    pumps = [asyncio.create_task(pump(p, request_id)) for p, request_id in enumerate(ids)]
    try:
        open_pumps = len(pumps)
        while open_pumps:
            item = await queue.get()
            if item is None:
                open_pumps -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()  # a pump still reading aborts its request as its stream closes
        await asyncio.gather(*pumps, return_exceptions=True)


def ended_early(state: ServerState, out: RequestOutput) -> ApiError:
    """A final output that is not a completion: the engine failed it, or shutdown aborted it."""
    if state.live.closing or out.finish_reason == "abort":
        return aborted(state)
    return ApiError(500, f"generation failed: {out.error}", code="engine_error")


def aborted(state: ServerState) -> ApiError:
    return shutting_down() if state.live.closing else ApiError(503, "the request was aborted", code="aborted")


async def _collect(state: ServerState, outputs: AsyncIterator[tuple[int, RequestOutput]], render: ManyChoices,
                   n: int) -> web.Response:
    choices = Choices(len(render.renderers))
    async for index, out in outputs:
        if out.finished and out.finish_reason in ("abort", "error"):
            raise ended_early(state, out)
        choices.add(index, out)
        if choices.done:
            body = render.whole(choices.outputs, choices.usage(n))
            return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                                headers={"X-Request-Id": render.id})
    raise ApiError(500, "the engine ended the request without a final output", code="engine_error")


async def _relay(request: web.Request, state: ServerState, outputs: AsyncIterator[tuple[int, RequestOutput]],
                 render: ManyChoices, include_usage: bool, n: int, ids: list[str]) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    try:
        response = await sse.open_stream(request, {"X-Request-Id": render.id})
        for chunk in render.opening():
            await response.write(sse.frame(chunk))
    except ConnectionResetError:  # the client left before its first event: an abort, not a server error
        await _abort(state, ids)
        return response or web.Response()  # aiohttp drops what it cannot send to a closed connection
    except BaseException:  # a write failed otherwise, or the handler was cancelled, before `outputs` started
        await _abort(state, ids)
        raise
    choices = Choices(len(render.renderers))
    try:
        async for index, out in outputs:
            if out.finished and out.finish_reason in ("abort", "error"):
                await response.write(sse.frame(ended_early(state, out).body()))
                break
            for chunk in render.delta(out, index):
                await response.write(sse.frame(chunk))
            choices.add(index, out)
            if choices.done:
                if include_usage:
                    await response.write(sse.frame(render.usage_chunk(choices.usage(n))))
                break
        await response.write(sse.DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client left while we wrote: the stream's cleanup aborts
        pass
    return response
