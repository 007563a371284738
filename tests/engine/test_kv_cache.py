"""kv_cache_dtype: the engine's KV pool in a narrower element type (half the bytes for the same
blocks), every policy still serving; a model dtype the CPU kernel cannot take gets the torch
backend under `auto`, and a clear refusal when the kernel is asked for by name; a pool larger
than the free memory is refused at start, naming num_blocks."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, memory
from engine.attention.cpu_backend import cpu_kernel_available
from engine.kv_cache import KVCache
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


def test_a_pool_larger_than_free_memory_is_refused_naming_num_blocks(monkeypatch):
    """Zeroing such a pool would end in the OOM killer, with no message: refuse it at start."""
    block = 2 * 2 * 16 * 2 * 8 * 4  # layers, k/v, block_size, kv heads, head_dim, float32 bytes
    monkeypatch.setattr(memory, "available_bytes", lambda device: 100 * block)
    assert KVCache(2, 90, 16, 2, 8).num_bytes == 90 * block  # within nine tenths of what is free
    with pytest.raises(ValueError, match=r"\[cache\] num_blocks = 91 needs .* GiB for the KV pool .* cpu has .* GiB free: "
                                         r"set num_blocks to at most 90 \(kv_cache_dtype = \"float16\" halves a block\)"):
        KVCache(2, 91, 16, 2, 8)
    with pytest.raises(ValueError, match=r"num_blocks = 181 .* at most 180$"):  # already 2 bytes: no hint
        KVCache(2, 181, 16, 2, 8, torch.float16)
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # no /proc/meminfo: not checked
    assert KVCache(2, 91, 16, 2, 8).num_blocks == 91


async def test_the_engine_refuses_to_start_with_a_pool_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)
    with pytest.raises(ValueError, match=r"\[cache\] num_blocks = 256 needs"):
        await Engine(tiny_config()).start()
