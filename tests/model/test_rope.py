"""Rotary tables cover the positions a sequence can reach here, not the model's whole context.

A 128k-context model would otherwise hold ~134 MB of cos/sin per table (head_dim 128, fp32)
while the KV pool caps every sequence far below that. Capped tables give the same logits, and a
position past them is an error, never a silent read.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.attention.torch_backend import TorchAttention
from engine.model.llama import LlamaModel
from engine.model.tiny import tiny_llama
from tests.engine.util import tiny_config
from tests.paged import PagedRunner


def test_tables_are_capped_and_give_the_same_logits():
    hf = tiny_llama()
    full, capped = LlamaModel(hf, TorchAttention()), LlamaModel(hf, TorchAttention(), max_positions=40)
    assert all(cos.shape[0] == hf.config.max_position_embeddings for cos, _ in full.rope.values())
    assert all(cos.shape[0] == sin.shape[0] == 40 for cos, sin in capped.rope.values())
    prompt = list(range(3, 43))  # positions 0..39: the last one the capped tables hold
    torch.testing.assert_close(PagedRunner(capped).step([(0, prompt)]), PagedRunner(full).step([(0, prompt)]),
                               atol=0, rtol=0)
    with pytest.raises(IndexError):
        PagedRunner(capped).step([(0, prompt + [5])])  # position 40


def test_a_cap_above_the_context_changes_nothing():
    hf = tiny_llama()
    model = LlamaModel(hf, TorchAttention(), max_positions=10 * hf.config.max_position_embeddings)
    assert all(cos.shape[0] == hf.config.max_position_embeddings for cos, _ in model.rope.values())


async def test_engine_caps_the_tables_at_its_kv_pool():
    async with Engine(tiny_config(num_blocks=8, block_size=16)) as engine:  # 128 tokens < 2048 positions
        assert engine.max_model_len == 2048
        assert {cos.shape[0] for cos, _ in engine.executor.model.rope.values()} == {8 * 16}
