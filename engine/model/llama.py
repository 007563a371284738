"""Our own Llama forward over a flattened, unpadded batch and a paged KV cache.

Weights are taken from a transformers Llama-family model (Llama, SmolLM, Mistral, Qwen2) and
re-laid for speed: q/k/v fused into one projection, gate/up fused into another, so each layer
runs four GEMMs instead of seven, each on a weight stored for the fastest kernel at hand
(engine/model/linear.py). Arithmetic follows transformers' Llama exactly (fp32 RMSNorm,
rotate-half RoPE from the model's own rotary tables) so greedy output matches token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model.linear import Linear, resolve
from engine.model.quant_linear import QuantLinear, native_weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [E]
    qkv: Linear | QuantLinear  # E -> (H + 2*KVH) * D, bias only for Qwen2
    o: Linear | QuantLinear  # H * D -> E
    post_norm: torch.Tensor  # [E]
    gate_up: Linear | QuantLinear  # E -> 2 * I
    down: Linear | QuantLinear  # I -> E


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rms_eps: float


class LlamaModel:
    def __init__(
        self, hf_model: PreTrainedModel, backend: AttentionBackend, device: torch.device | str = "cpu", linear: str = "auto",
        gguf: Path | None = None, weight_format: str = "auto",
    ):
        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            rms_eps=cfg.rms_norm_eps,
        )
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}; only SwiGLU (silu) Llama models")
        self.backend = backend
        self.device = torch.device(device)
        inner = hf_model.model
        self.embed = self._own(inner.embed_tokens.weight)  # [V, E]
        self.linear = resolve(linear, self.device, self.embed.dtype)
        # int8 stays inside the layers: the LM head picks the token, so it keeps full precision
        head = resolve("auto", self.device, self.embed.dtype) if self.linear == "int8" else self.linear
        # GGUF blocks of the projections the native kernel runs, by id of the HF parameter (None: all dense)
        self._blocks = native_weights(hf_model, gguf, weight_format, self.device, self.embed.dtype, self.linear)
        self.weight_format = "gguf" if self._blocks is not None else "dequantized"
        self.lm_head = self._linear([hf_model.lm_head.weight], kind=head)  # E -> V
        self.final_norm = self._own(inner.norm.weight)
        self.layers = [self._take_layer(layer) for layer in inner.layers]
        # cos/sin tables from the model's own rotary module, so every RoPE variant matches.
        positions = torch.arange(self.shape.max_position)[None]
        cos, sin = inner.rotary_emb(self.embed[:1][None], positions)
        self.cos = cos[0].to(self.device, self.embed.dtype)  # [P, D]
        self.sin = sin[0].to(self.device, self.embed.dtype)

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of a weight on our device: nothing is shared with the transformers model,
        which can then be freed (and its memory-mapped weight file unmapped)."""
        return t.detach().to(self.device, copy=True)

    def _linear(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None, kind: str | None = None):
        """A projection on our device from `weights` stacked by rows, stored for `kind` (default:
        the model's linear backend); on the GGUF blocks as well where they are kept."""
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        dense = Linear(weight.detach().to(self.device), bias, kind or self.linear)
        blocks = None if self._blocks is None else [self._blocks.get(id(w)) for w in weights]
        if blocks is None or None in blocks or len({b.qtype for b in blocks}) > 1:
            return dense
        return QuantLinear(blocks, bias, dense)

    def _take_layer(self, layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        bias = None
        if attn.q_proj.bias is not None:
            bias = self._own(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        if getattr(attn.o_proj, "bias", None) is not None or getattr(mlp.gate_proj, "bias", None) is not None:
            raise ValueError("unsupported: bias on o_proj or MLP projections")
        return LayerWeights(
            input_norm=self._own(layer.input_layernorm.weight),
            qkv=self._linear(qkv, bias),
            o=self._linear([attn.o_proj.weight]),
            post_norm=self._own(layer.post_attention_layernorm.weight),
            gate_up=self._linear([mlp.gate_proj.weight, mlp.up_proj.weight]),
            down=self._linear([mlp.down_proj.weight]),
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.rms_eps)
        return weight * x.to(dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos/sin: [T, 1, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_rows: torch.Tensor,  # [B] rows of the flattened batch whose logits are wanted
    ) -> torch.Tensor:  # [B, V] float32
        s = self.shape
        num_tokens = input_ids.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        prepared = self.backend.prepare(meta)
        cos = self.cos[positions][:, None, :]  # [T, 1, D]
        sin = self.sin[positions][:, None, :]
        h = self.embed[input_ids]  # [T, E]
        for i, w in enumerate(self.layers):
            x = self.rms_norm(h, w.input_norm)
            qkv = w.qkv(x)  # [T, (H + 2 KVH) D]
            q = qkv[:, :q_size].view(num_tokens, s.num_heads, s.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size :].view(num_tokens, s.num_kv_heads, s.head_dim)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            k_cache, v_cache = kv_cache.layer(i)
            attn = self.backend.forward(q, k, v.contiguous(), k_cache, v_cache, meta, prepared)  # [T, H, D]
            h = h + w.o(attn.reshape(num_tokens, q_size))
            x = self.rms_norm(h, w.post_norm)
            gate, up = w.gate_up(x).chunk(2, dim=-1)  # [T, I] each
            h = h + w.down(F.silu(gate) * up)
        last = self.rms_norm(h[logits_rows], self.final_norm)  # [B, E]
        return self.lm_head(last).float()
