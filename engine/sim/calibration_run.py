"""A short real run for `engine-sim calibrate --run`: a bench workload through the engine on the
configured model, its StepRecords kept. This is calibration, not simulation: it loads torch."""

from __future__ import annotations

import asyncio

from engine.config import EngineConfig
from engine.messages import StepRecord


def calibration_run(config: EngineConfig, name: str, num_requests: int | None) -> tuple[list[StepRecord], int, str, int]:
    """Returns the run's steps, the model's context length, its name and its vocabulary size."""
    from engine.bench import workload
    from engine.bench.runner import run_in_process
    from engine.engine import Engine

    async def run():
        async with Engine(config) as engine:
            requests = workload.make(name, 0, num_requests, 0.0, len(engine.tokenizer))
            _, _, steps = await run_in_process(engine, requests)
            return steps, engine.max_model_len, config.model.model, len(engine.tokenizer)

    return asyncio.run(run())
