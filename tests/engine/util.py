"""Helpers shared by the engine tests: configs, running a request to the end, recording
StepRecords, waiting (with a bound) for the engine to drain."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from pathlib import Path

from engine import Engine, EngineConfig, RequestOutput, SamplingParams, StepRecord
from tests import tiny

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("static", "continuous", "chunked")


tiny_config = functools.partial(tiny.tiny_config, batch_timeout_ms=5)


def real_config(**overrides) -> EngineConfig:
    return EngineConfig.load(REPO / "config.toml", **{"num_blocks": 256, **overrides})


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@dataclass
class Result:
    request_id: str
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def final(self) -> RequestOutput:
        assert self.outputs and self.outputs[-1].finished, "no final output"
        return self.outputs[-1]

    @property
    def finish_reason(self) -> str | None:
        return self.final.finish_reason


async def run_request(engine: Engine, prompt=None, params: SamplingParams | None = None, **kw) -> Result:
    request_id = await engine.submit(prompt, params, **kw)
    result = Result(request_id)
    async for out in engine.stream(request_id):
        result.outputs.append(out)
    return result


async def run_all(engine: Engine, prompts: list, params: list[SamplingParams], timeout: float = 120) -> list[Result]:
    """Submit every request at once (all in flight together) and stream them to the end."""
    async with asyncio.timeout(timeout):
        ids = [await engine.submit(p, sp) for p, sp in zip(prompts, params)]
        results = [Result(i) for i in ids]

        async def consume(r: Result) -> None:
            async for out in engine.stream(r.request_id):
                r.outputs.append(out)

        await asyncio.gather(*(consume(r) for r in results))
    return results


class StepRecorder:
    """Collects every StepRecord from the moment `start` returns."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.records: list[StepRecord] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> StepRecorder:
        async def consume() -> None:
            async for record in self.engine.steps():
                self.records.append(record)

        self._task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the task runs up to its first await: subscribed from now on
        assert self.engine._subscribers, "step subscriber did not register"
        return self

    async def caught_up(self, timeout: float = 10) -> list[StepRecord]:
        """Wait until the record of the scheduler's latest step has arrived."""
        async with asyncio.timeout(timeout):
            while self.engine.scheduler.step and (not self.records or self.records[-1].step < self.engine.scheduler.step):
                await asyncio.sleep(0.005)
        return self.records

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def wait_idle(engine: Engine, timeout: float = 10) -> None:
    """Poll (bounded) until nothing runs or waits and every KV block is free."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                snap = engine.snapshot()
                if not snap.running and not snap.waiting and snap.kv_usage == 0 and not engine.block_manager.inbox.qsize():
                    return
                await asyncio.sleep(0.005)
    except TimeoutError:
        snap = engine.snapshot()
        raise AssertionError(
            f"engine did not drain in {timeout}s: running={[r.request_id for r in snap.running]} "
            f"waiting={[r.request_id for r in snap.waiting]} kv_usage={snap.kv_usage}"
        ) from None


async def assert_drained(engine: Engine, timeout: float = 10) -> None:
    await wait_idle(engine, timeout)
    snap = engine.snapshot()
    assert snap.running == [] and snap.waiting == []
    assert snap.kv_usage == 0 and snap.num_free_blocks == snap.num_blocks
    engine.block_manager.check_invariants()
