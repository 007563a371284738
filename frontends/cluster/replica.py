"""EngineReplica: one Engine inside one Ray Serve replica (the deployment's class).

The ingress calls it through a `DeploymentHandle`; `generate` and `steps` are async
generators, read with `handle.options(stream=True)`. `generate` takes token ids (the ingress
tokenized the prompt to route it) and first yields its verdict — `ACCEPTED`, or a `Refusal`
naming the engine error — so the ingress can answer a refused request with the same HTTP
error as `engine-serve` before anything is streamed; then the engine's RequestOutputs.
Cancelling the stream at the ingress cancels `generate` here, which aborts the request.

Each replica keeps its own Prometheus metrics, fed by its own step feed (the same classes as
the single-process server); the ingress merges them with a `replica` label. Ray's health
check calls `check_health`: a dead engine fails it and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import msgspec

from engine import Engine, EngineConfig, RequestOutput, SamplingParams, StepRecord
from engine.errors import EngineDeadError, QueueFullError, RequestAbortedError, RequestError
from frontends.http.feed import StepFeed
from frontends.http.metrics import Metrics
from frontends.http.observe import state_of

ACCEPTED = "accepted"


class Refusal(msgspec.Struct, frozen=True):
    kind: str  # the engine error's class name
    message: str
    param: str | None = None


class EngineReplica:
    async def __init__(self, config: dict, name: str):
        self.name = name
        self.config = EngineConfig.from_dict(config)
        self.engine = await Engine(self.config).start()
        self.metrics = Metrics(self.engine, self.config.served_model_name)
        self.feed = StepFeed(self.engine, self.metrics)
        self._feed_task = asyncio.create_task(self.feed.run(), name="stepwise-replica-step-feed")

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[str | Refusal | RequestOutput]:
        try:
            await self.engine.submit(prompt_ids, params, request_id=request_id)
        except (RequestError, QueueFullError, EngineDeadError, RequestAbortedError) as e:
            yield Refusal(type(e).__name__, str(e), getattr(e, "param", None))
            return
        yield ACCEPTED
        async for out in self.engine.stream(request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def steps(self) -> AsyncIterator[StepRecord]:
        with self.feed.subscribe() as records:
            async for record in records:
                yield record

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def state(self) -> dict:
        return state_of(self.engine)

    def describe(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "max_model_len": self.engine.max_model_len}

    def check_health(self) -> None:
        if self.engine.dead:
            raise RuntimeError(f"engine dead: {self.engine.dead}")

    async def __del__(self) -> None:
        self._feed_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._feed_task
        await self.engine.stop()
