"""The machine's compute limit for a workload: the output tokens/s it would deliver if every
processed token (prompt and output alike) went at the machine's measured prefill rate.

    limit = prefill rate x output tokens / (prompt tokens + output tokens)

The prefill rate is measured in the same run, on 512-token prompts (median of three, after a
warm-up): transformers' own forward (`hf_model(ids, logits_to_keep=1)`, the reference issue #8
names) and our engine's forward step (StepRecord.forward_s of one 512-token prefill). A decode
token costs the same FLOPs as a prompt token but runs in smaller, less efficient GEMMs, so no
policy reaches the limit; the fraction reached says how close one gets.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import torch

from engine.bench.workload import BenchRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel
from engine.request import SamplingParams

PROMPT_LEN = 512
REPEATS = 3


def _prompts(vocab_size: int, n: int) -> list[list[int]]:
    rng = random.Random(1234)
    low = min(100, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(n)]


@torch.inference_mode()
def transformers_prefill_rate(loaded: LoadedModel, vocab_size: int) -> float:
    """Prompt tokens/s of transformers' forward on one 512-token prompt."""
    model = loaded.hf_model
    times = []
    for i, prompt in enumerate(_prompts(vocab_size, REPEATS + 1)):
        ids = torch.tensor([prompt], device=model.device)
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        if i:  # the first one warms up
            times.append(time.perf_counter() - start)
    return PROMPT_LEN / statistics.median(times)


async def engine_prefill_rate(config: EngineConfig, loaded: LoadedModel, vocab_size: int) -> float:
    """Prompt tokens/s of our forward step (StepRecord.forward_s) on one 512-token prompt."""
    config = config.with_overrides(policy="continuous", max_num_batched_tokens=max(PROMPT_LEN, 1))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    async with Engine(config, loaded=loaded) as engine:
        records = engine.steps()  # subscribed before the first request: no record is missed
        pending = asyncio.ensure_future(anext(records))
        await asyncio.sleep(0)  # the subscription happens when that task first runs
        for i, prompt in enumerate(_prompts(vocab_size, REPEATS + 1)):
            async for out in engine.generate(prompt, params):
                pass
            while True:  # the step that prefilled this prompt
                record = await pending
                pending = asyncio.ensure_future(anext(records))
                if any(it.request_id == out.request_id and it.kind == "prefill" for it in record.items):
                    break
            if i:  # the first one warms up
                times.append(record.forward_s)
        pending.cancel()
    return PROMPT_LEN / statistics.median(times)


def output_limit(prefill_rate: float, requests: list[BenchRequest]) -> float:
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.max_tokens for r in requests)
    return prefill_rate * output / (prompt + output)
