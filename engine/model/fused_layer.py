"""A layer's work around attention in two C++ calls, for steps the GGUF kernel runs.

A decode step of one row spends as long in ~45 small ATen ops per layer (norms, RoPE, slicing,
residual adds, each a Python call and a dispatch) as in its projections. Where every projection
of every layer runs on GGUF blocks (weight_format "gguf", fp32 activations) and the layer is
plain Llama arithmetic, a step of at most `max_rows` rows runs each layer as:

    attn_in       rms_norm -> qkv projection (+ bias) -> RoPE on q and k      (C++)
    attention     the configured backend, unchanged                           (store K/V, attend)
    attn_out_mlp  o projection -> residual -> rms_norm -> gate/up -> silu * up -> down -> residual  (C++)

With the CPU attention backend the loop itself runs in C++ too (`layers_in_one_call`: one call
a step, the attention kernel called between the halves), which saves the ~30 us of Python per
layer that slicing q/k/v and calling three ops costs.

Same arithmetic as the op-by-op path (engine/model/csrc/decode_layer_impl.h says where the
rounding order is kept); only the order of fp32 additions in the norms and products differs,
as it already does between the kernel and the dense copy. Families with other arithmetic
(Gemma norms, q/k norms, gelu) and the int8-activation kernel keep the op-by-op path.
"""

from __future__ import annotations

import torch

from engine.model import quant_kernel
from engine.model.quant_linear import QuantLinear


class FusedLayers:
    def __init__(self, layers, eps: float, heads: int, kv_heads: int, head_dim: int, attention):
        self.layers = layers
        self.eps = eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.max_rows = min(p.max_rows for w in layers for p in (w.qkv, w.o, w.gate_up, w.down))
        self._ops = torch.ops.stepwise_gguf
        # every layer in one call (`layers`): its arguments, flattened per layer, built once
        projections = [(w.qkv, w.o, w.gate_up, w.down) for w in layers]
        self._weights = [t for w, (qkv, o, gu, down) in zip(layers, projections)
                         for t in (w.input_norm.weight, qkv.blocks, o.blocks, w.post_attn_norm.weight, gu.blocks, down.blocks)]
        self._types = [_type_id(p) for ps in projections for p in ps]
        self._biases = [p.bias for ps in projections for p in ps]
        self._block_scales = [p.scales for ps in projections for p in ps]
        self._isa = quant_kernel.ISAS[layers[0].qkv.isa]
        self._scale = [a.scale for a in attention]
        self._window = [a.window or 0 for a in attention]
        self._softcap = [a.softcap or 0.0 for a in attention]

    @classmethod
    def for_model(cls, model) -> FusedLayers | None:
        """The fused path for `model` (an engine LlamaModel), or None where its layers need the
        op-by-op path."""
        spec = model.spec
        plain = not spec.gemma_norms and spec.activation == "silu" and model.device.type == "cpu"
        if not plain or model.embed.dtype != torch.float32:  # the norms' weights share the model's dtype
            return None
        for w in model.layers:
            projections = (w.qkv, w.o, w.gate_up, w.down)
            if w.q_norm is not None or w.pre_ff_norm is not None or w.post_ff_norm is not None:
                return None
            if not all(isinstance(p, QuantLinear) and not p.int8_activations for p in projections):
                return None
        s = model.shape
        return cls(model.layers, s.rms_eps, s.num_heads, s.num_kv_heads, s.head_dim, spec.attention)

    def layers_in_one_call(self, h: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], kv: torch.Tensor,
                           plan) -> None:
        """h [T, E] through every layer in one C++ call, attention by the CPU kernel. rope: each
        layer's (cos, sin) rows [T, R]; kv: the whole cache [L, 2, blocks, block_size, KVH, D];
        plan: the CPU attention backend's CpuPlan for this step."""
        self._ops.layers(h, self._weights, self._types, self._biases, [c for c, _ in rope], [s for _, s in rope],
                         self.heads, self.kv_heads, self.head_dim, self.eps, self._isa, kv, plan.slot_mapping,
                         plan.tiles, plan.block_tables, self._scale, self._window, self._softcap, self._block_scales)

    def attn_in(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [T, E], cos/sin [T, R] -> qkv [T, (H + 2 KVH) D], q and k rotated."""
        w = self.layers[i]
        p = w.qkv
        qkv = torch.empty(h.shape[0], p.blocks.shape[0], dtype=torch.float32)
        self._ops.attn_in(h, w.input_norm.weight, self.eps, p.blocks, _type_id(p), p.bias, cos, sin,
                          self.heads, self.kv_heads, self.head_dim, quant_kernel.ISAS[p.isa], qkv, p.scales)
        return qkv

    def attn_out_mlp(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> None:
        """h [T, E] += the rest of layer i, given its attention output attn [T, H D]."""
        w = self.layers[i]
        o, gu, down = w.o, w.gate_up, w.down
        self._ops.attn_out_mlp(h, attn, o.blocks, _type_id(o), o.bias, w.post_attn_norm.weight, self.eps,
                               gu.blocks, _type_id(gu), gu.bias, down.blocks, _type_id(down), down.bias,
                               quant_kernel.ISAS[o.isa], [o.scales, gu.scales, down.scales])


def _type_id(p: QuantLinear) -> int:
    return quant_kernel.KERNEL_TYPES[p.qtype][0]
