"""Our decoder forward over a flattened, unpadded batch and a paged KV cache.

One code path for every supported family (engine/model/spec.py: Llama, Mistral, Qwen2/2.5,
Qwen3, Gemma 2/3, Phi-3); what differs comes from the model's `ModelSpec` (norm arithmetic,
q/k norms, activation, soft-caps, per-layer sliding windows and rotary tables) and from the
weights present (biases, fused projections). Weights are taken from the transformers model and
re-laid for speed: q/k/v fused into one projection, gate/up into another, so each layer runs
four GEMMs instead of seven, each on a weight stored for the fastest kernel at hand
(engine/model/linear.py). Arithmetic follows transformers exactly (fp32 RMSNorm, rotate-half
RoPE from the model's own rotary tables) so greedy output matches token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuPlan
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model.embedding import Embedding
from engine.model.fused_layer import FusedLayers
from engine.model.gguf_weights import LOSSLESS_TO_Q8_0, to_q8_0
from engine.model.linear import Linear, resolve
from engine.model.quant_linear import QuantLinear, QuantLinearStack, native_weights
from engine.model.norm import RMSNorm
from engine.model.rope import apply_rope, rope_tables
from engine.model.spec import ModelShape, ModelSpec, spec_from_config

__all__ = ["LlamaModel", "ModelShape", "ModelSpec"]


@dataclass
class LayerWeights:
    input_norm: RMSNorm
    qkv: Linear | QuantLinear | QuantLinearStack  # E -> (H + 2*KVH) * D (bias when the model has one, e.g. Qwen2)
    o: Linear | QuantLinear  # H * D -> E
    post_attn_norm: RMSNorm  # Llama: before the MLP; Gemma: on the attention output
    gate_up: Linear | QuantLinear | QuantLinearStack  # E -> 2 * I
    down: Linear | QuantLinear  # I -> E
    q_norm: RMSNorm | None = None  # Qwen3, Gemma 3: per head, before RoPE
    k_norm: RMSNorm | None = None
    pre_ff_norm: RMSNorm | None = None  # Gemma: before the MLP
    post_ff_norm: RMSNorm | None = None  # Gemma: on the MLP output


class LlamaModel:
    def __init__(
        self, hf_model: PreTrainedModel, backend: AttentionBackend, device: torch.device | str = "cpu", linear: str = "auto",
        gguf: Path | None = None, weight_format: str = "auto", max_positions: int | None = None,
    ):
        cfg = hf_model.config
        self.spec = spec_from_config(cfg, type(hf_model).__name__)  # the class whose modules we read
        self.shape = self.spec.shape
        self.backend = backend
        self.device = torch.device(device)
        inner = hf_model.model
        self.dtype = inner.embed_tokens.weight.dtype  # of the weights and activations
        scale = getattr(inner.embed_tokens, "embed_scale", None)  # Gemma: sqrt(E), in the weight's dtype
        self.embed_scale = None if scale is None else scale.to(self.device, self.dtype)
        self.linear = resolve(linear, self.device, self.dtype)
        # int8 stays inside the layers: the LM head picks the token, so it keeps full precision
        head = resolve("auto", self.device, self.dtype) if self.linear == "int8" else self.linear
        # GGUF blocks of the projections the native kernel runs, by id of the HF parameter (None: all dense)
        self._blocks = native_weights(hf_model, gguf, weight_format, self.device, self.dtype, self.linear)
        # "auto" resolves to "gguf" or "dequantized"; "gguf-q8" quantizes the kernel's activations to int8
        native = "gguf-q8" if weight_format == "gguf-q8" else "gguf"
        self.weight_format = "dequantized" if self._blocks is None else native
        blocks = None if self._blocks is None else self._blocks.get(id(inner.embed_tokens.weight))
        self.embed = Embedding(blocks=blocks) if blocks is not None else Embedding(self._own(inner.embed_tokens.weight))
        self.lm_head = self._linear([hf_model.lm_head.weight], getattr(hf_model.lm_head, "bias", None), kind=head)  # E -> V
        self.final_norm = self._norm(inner.norm)
        self.layers = [self._take_layer(layer) for layer in inner.layers]
        # cos/sin tables from the model's own rotary module, so every RoPE variant matches; for
        # the positions a sequence can reach here (max_positions: the KV pool's tokens), not more
        table_len = min(self.shape.max_position, max_positions or self.shape.max_position)
        self.rope = rope_tables(inner.rotary_emb, set(self.spec.rope_keys), table_len, self.dtype, self.device)
        # the layers run in C++ on CPU in fp32 (engine/model/fused_layer.py; None: op by op)
        self.fused = FusedLayers.for_model(self)

    @property
    def small_step_rows(self) -> int | None:
        """The most rows (tokens) a step runs on the GGUF kernels before the dense copies take
        over: the step-cost model fits the two regimes apart. None: every step runs one path."""
        if self.fused is not None and self.fused.kernel is not None:
            return self.fused.max_rows
        rows = [lin.max_rows for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down)
                if isinstance(lin, (QuantLinear, QuantLinearStack)) and lin.dense is not None]
        return min(rows) if rows else None

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of a weight on our device: nothing is shared with the transformers model,
        which can then be freed (and its memory-mapped weight file unmapped)."""
        return t.detach().to(self.device, copy=True)

    def _linear(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None, kind: str | None = None):
        """A projection on our device from `weights` stacked by rows, stored for `kind` (default:
        the model's linear backend); on the GGUF blocks as well where they are kept."""
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        bias = None if bias is None else self._own(bias)
        dense = Linear(weight.detach().to(self.device), bias, kind or self.linear)
        blocks = None if self._blocks is None else [self._blocks.get(id(w)) for w in weights]
        if blocks is None or None in blocks:
            return dense
        q8 = self.weight_format == "gguf-q8"
        if len({b.qtype for b in blocks}) > 1 and all(b.qtype in LOSSLESS_TO_Q8_0 for b in blocks):
            blocks = [to_q8_0(b) for b in blocks]  # e.g. Q5_0 q/k with Q8_0 v: one Q8_0 weight, exactly
        if len({b.qtype for b in blocks}) == 1:
            return QuantLinear(blocks, bias, dense, int8_activations=q8)
        return QuantLinearStack([QuantLinear([b], None, None, int8_activations=q8) for b in blocks], bias, dense)

    def _norm(self, module) -> RMSNorm:
        return RMSNorm(self._own(module.weight), self.shape.rms_eps, gemma=self.spec.gemma_norms)

    def _take_layer(self, layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # Phi-3 stores them fused already
            qkv = self._linear([attn.qkv_proj.weight], attn.qkv_proj.bias)
        else:
            qkv = self._fused(attn.q_proj, attn.k_proj, attn.v_proj)
        if hasattr(mlp, "gate_up_proj"):
            gate_up = self._linear([mlp.gate_up_proj.weight], mlp.gate_up_proj.bias)
        else:
            gate_up = self._fused(mlp.gate_proj, mlp.up_proj)
        gemma = self.spec.gemma_norms
        has_qk_norm = hasattr(attn, "q_norm")
        return LayerWeights(
            input_norm=self._norm(layer.input_layernorm),
            qkv=qkv,
            o=self._linear([attn.o_proj.weight], attn.o_proj.bias),
            post_attn_norm=self._norm(layer.post_attention_layernorm),
            gate_up=gate_up,
            down=self._linear([mlp.down_proj.weight], mlp.down_proj.bias),
            q_norm=self._norm(attn.q_norm) if has_qk_norm else None,
            k_norm=self._norm(attn.k_norm) if has_qk_norm else None,
            pre_ff_norm=self._norm(layer.pre_feedforward_layernorm) if gemma else None,
            post_ff_norm=self._norm(layer.post_feedforward_layernorm) if gemma else None,
        )

    def _fused(self, *projs) -> Linear | QuantLinear | QuantLinearStack:
        """One projection computing several (outputs stacked in order); a missing bias is 0."""
        bias = None
        if any(p.bias is not None for p in projs):
            bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in projs])
        return self._linear([p.weight for p in projs], bias)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.spec.activation == "silu" else F.gelu(gate, approximate="tanh")

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_rows: torch.Tensor,  # [B] rows of the flattened batch whose logits are wanted
    ) -> torch.Tensor:  # [B, V] float32
        s, spec = self.shape, self.spec
        num_tokens, q_size = input_ids.shape[0], s.num_heads * s.head_dim
        prepared = self.backend.prepare(meta)
        rope = {key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope.items()}  # [T, R] each
        h = self.embed(input_ids)  # [T, E]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        fused = self.fused
        if fused is not None and isinstance(prepared, CpuPlan) and fused.weights_for(num_tokens) is not None:
            fused.layers_in_one_call(h, [rope[key] for key in spec.rope_keys], kv_cache.data, prepared)
            return self._logits(h, logits_rows)
        if fused is not None and fused.plain and num_tokens <= fused.max_rows:
            return self._forward_halves(h, rope, meta, kv_cache, prepared, logits_rows)
        for i, w in enumerate(self.layers):
            x = w.input_norm(h)
            q, k, v = self._heads(w.qkv(x))
            if w.q_norm is not None:
                q, k = w.q_norm(q), w.k_norm(k)
            cos, sin = rope[spec.rope_keys[i]]
            cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R] each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache, v_cache = kv_cache.layer(i)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta, prepared, spec.attention[i])
            o = w.o(attn.reshape(num_tokens, q_size))  # [T, E]
            if w.pre_ff_norm is not None:  # Gemma: norm the attention output, then the MLP input
                h = h + w.post_attn_norm(o)
                x = w.pre_ff_norm(h)
            else:
                h = h + o
                x = w.post_attn_norm(h)
            gate, up = w.gate_up(x).chunk(2, dim=-1)  # [T, I] each
            y = w.down(self.activation(gate) * up)  # [T, E]
            h = h + (y if w.post_ff_norm is None else w.post_ff_norm(y))
        return self._logits(h, logits_rows)

    def _forward_halves(self, h, rope, meta, kv_cache, prepared, logits_rows) -> torch.Tensor:
        """forward() for a step of few rows on GGUF blocks with an attention backend other than
        the CPU kernel: each layer is two C++ calls around it (engine/model/fused_layer.py)."""
        spec, fused = self.spec, self.fused
        num_tokens, q_size = h.shape[0], self.shape.num_heads * self.shape.head_dim
        for i in range(len(self.layers)):
            cos, sin = rope[spec.rope_keys[i]]
            q, k, v = self._heads(fused.attn_in(i, h, cos, sin))  # q and k rotated
            k_cache, v_cache = kv_cache.layer(i)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta, prepared, spec.attention[i])
            fused.attn_out_mlp(i, h, attn.reshape(num_tokens, q_size))
        return self._logits(h, logits_rows)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 KVH) D] -> q [T, H, D], k [T, KVH, D] (views), v [T, KVH, D] (contiguous)."""
        s, t = self.shape, qkv.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[:, :q_size].view(t, s.num_heads, s.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, s.num_kv_heads, s.head_dim)
        return q, k, qkv[:, q_size + kv_size :].reshape(t, s.num_kv_heads, s.head_dim).contiguous()

    def _logits(self, h: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:  # -> [B, V] float32
        spec = self.spec
        last = self.final_norm(h[logits_rows])  # [B, E]
        logits = self.lm_head(last)  # [B, V]
        if spec.final_softcap is not None:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits.float()
