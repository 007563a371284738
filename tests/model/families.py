"""Tiny random models of every supported family, each with its real features switched on, saved
as Hugging Face directories (config.json, safetensors, generation_config.json, the tiny byte
tokenizer) so tests load them through the normal loader path."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from engine.model.tiny import tiny_tokenizer

WINDOW = 24  # sliding window: shorter than the test prompts, longer than a chunk (16)
VOCAB = 259  # the tiny tokenizer's size
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
    pad_token_id=0,
)


def _with(**kw) -> dict:
    return {**COMMON, **kw}


FAMILIES = {
    # Llama 3.x: llama3 RoPE scaling (original context 64 < 256: the low frequencies are scaled),
    # untied LM head, several stop tokens in generation_config.json
    "llama3": lambda: LlamaConfig(**_with(
        head_dim=16, tie_word_embeddings=False, eos_token_id=[2, 1],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    # Qwen2.5: q/k/v bias; sliding window on the layers from max_window_layers on
    "qwen2": lambda: Qwen2Config(**_with(
        num_hidden_layers=3, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim (4 x 32 != hidden 64), no bias
    "qwen3": lambda: Qwen3Config(**_with(head_dim=32, tie_word_embeddings=True, attention_bias=False)),
    # Mistral: a sliding window on every layer
    "mistral": lambda: MistralConfig(**_with(head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False)),
    # Gemma 2: everything Gemma, soft-caps that bite, alternating sliding/global layers
    "gemma2": lambda: Gemma2Config(**_with(
        num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=10.0, hidden_activation="gelu_pytorch_tanh",
    )),
    # Gemma 3: q/k norm, a local and a global RoPE base (global one linearly scaled)
    "gemma3": lambda: Gemma3TextConfig(**_with(
        num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    )),
    # Phi-3: fused qkv / gate_up weights, sliding window on every layer, partial rotary
    "phi3": lambda: Phi3Config(**_with(
        sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )),
}


def build(family: str, seed: int = 0):
    """A random model of `family`, weights large enough for decisive greedy text."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            else:  # norm weights and biases away from their neutral values
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save(family: str, out: Path) -> Path:
    model = build(family)
    model.save_pretrained(out)  # config.json, model.safetensors, generation_config.json
    tiny_tokenizer().save_pretrained(out)
    return out
