"""kv_cache_dtype: the engine's KV pool in a narrower element type (half the bytes for the same
blocks), every policy still serving; and a model dtype the CPU kernel cannot take gets the torch
backend under `auto`, and a clear refusal when the kernel is asked for by name."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.attention.cpu_backend import cpu_kernel_available
from tests.engine.util import POLICIES, greedy, run_all, tiny_config

PROMPTS = [[5 + i % 250 for i in range(n)] for n in (3, 40, 300)]  # 300 tokens: several prefill chunks


async def serve(engine: Engine) -> list[list[int]]:
    results = await run_all(engine, PROMPTS, [greedy(12)] * len(PROMPTS))
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
async def test_a_narrow_kv_pool_takes_half_the_bytes_and_serves(policy, kv_cache_dtype):
    async with Engine(tiny_config(policy=policy)) as full:
        full_bytes = full.executor.kv_cache.num_bytes
        assert full.executor.kv_cache.data.dtype == torch.float32
    async with Engine(tiny_config(policy=policy, kv_cache_dtype=kv_cache_dtype)) as narrow:
        cache = narrow.executor.kv_cache
        assert cache.data.dtype == getattr(torch, kv_cache_dtype) and cache.num_blocks == 256
        assert cache.num_bytes * 2 == full_bytes
        outs = await serve(narrow)
    assert all(len(o) == 12 for o in outs)


async def test_a_float16_model_on_cpu_gets_the_torch_backend():
    """The CPU kernel runs float32 and bfloat16 activations: `auto` must not hand it a float16
    model (every request used to fail with the kernel's dtype error)."""
    async with Engine(tiny_config(dtype="float16")) as engine:
        assert engine.executor.model.backend.name == "torch"
        outs = await serve(engine)
    assert all(len(o) == 12 for o in outs)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel")
async def test_the_cpu_kernel_by_name_refuses_a_float16_model():
    with pytest.raises(ValueError, match="attention_backend 'cpu': the CPU kernel runs float32 or bfloat16 models, "
                                         "not dtype float16"):
        await Engine(tiny_config(attention_backend="cpu", dtype="float16")).start()
