"""A layer's work around attention in C++: two calls a layer, or the whole layer loop in one.

A decode step of one row spends as long in ~45 small ATen ops per layer (norms, RoPE, slicing,
residual adds, each a Python call and a dispatch) as in its projections; a step of many rows
still spends ~10 % of its time in them and in Python. On CPU in fp32, each layer runs as:

    attn_in       rms_norm -> qkv projection (+ bias) -> RoPE on q and k      (C++)
    attention     the configured backend, unchanged                           (store K/V, attend)
    attn_out_mlp  o projection -> residual -> rms_norm -> gate/up -> silu * up -> down -> residual  (C++)

Two sets of weights can run it:
- kernel: every projection on GGUF blocks (QuantLinear, fp32 activations; a QuantLinearStack's
  parts of different block types, each into its own output columns), for steps of at most
  `max_rows` rows, where our block kernel beats the dense copy;
- dense: every projection's oneDNN-prepacked fp32 weight (the QuantLinear's dense copy, or the
  Linear of a dequantized / Hugging Face model), for any step, called from C++ as the Python
  path calls it (torch.ops.mkldnn._linear_pointwise).
With the CPU attention backend the loop itself runs in C++ too (`layers_in_one_call`: one call
a step, the attention kernel called between the halves), which saves the ~30 us of Python per
layer that slicing q/k/v and calling three ops costs, on either set. Without it, kernel steps
run the two halves from Python, and other steps op by op.

Same arithmetic as the op-by-op path (engine/model/csrc/decode_layer_impl.h says where the
rounding order is kept); only the order of fp32 additions in the norms and products differs,
as it already does between the kernel and the dense copy. What Qwen3 and Gemma add to a layer
(q/k norms, Gemma's norms on the attention and MLP outputs, GeGLU: `extra_norms`, `gelu`) runs
in the one-call loop only: such models' kernel steps with another attention backend, and the
int8-activation kernel's ("gguf-q8"), stay op by op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import quant_kernel
from engine.model.linear import Linear
from engine.model.quant_linear import QuantLinear, QuantLinearStack

DENSE = -1  # a projection's type id in the C++ ops when its weight is a oneDNN-prepacked fp32 one


@dataclass(frozen=True)
class _Weights:
    """One weight set of every layer, flattened as the C++ `layers` op takes it."""

    norms: list[torch.Tensor]  # per layer: input norm, the MLP's input norm
    parts: list[int]  # per layer: how many weights qkv, o, gate/up, down each stack (1 but for a QuantLinearStack)
    weights: list[torch.Tensor]  # those weights in order: GGUF blocks, or a oneDNN-prepacked dense one
    types: list[int]  # each weight's ggml type id, or DENSE
    scales: list[torch.Tensor | None]  # each weight's fp32 scale pairs (block_scales), or None
    biases: list[torch.Tensor | None]  # per layer: qkv, o, gate/up, down


def _mlp_norms(w) -> tuple:
    """A layer's MLP input norm, and the norm on its attention output (Gemma's; None for Llama,
    whose post-attention norm is the MLP's input norm)."""
    return (w.pre_ff_norm, w.post_attn_norm) if w.pre_ff_norm is not None else (w.post_attn_norm, None)


def _extra_norms(w) -> list[torch.Tensor | None]:
    """A layer's q norm, k norm, and norms of the attention and MLP outputs (Gemma), as the C++
    loop takes them: fp32 weights (Gemma's already 1 + w), None where absent."""
    return [None if n is None else n.weight for n in (w.q_norm, w.k_norm, _mlp_norms(w)[1], w.post_ff_norm)]


def _dense(p) -> Linear | None:
    """A projection's oneDNN-prepacked fp32 weight, or None where it has none."""
    dense = p.dense if isinstance(p, (QuantLinear, QuantLinearStack)) else p
    return dense if isinstance(dense, Linear) and dense.kind == "onednn" else None


class FusedLayers:
    def __init__(self, layers, eps: float, heads: int, kv_heads: int, head_dim: int, attention,
                 kernel: bool, dense: bool, gelu: bool = False):
        self.layers = layers
        self.eps = eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._ops = torch.ops.stepwise_gguf
        projections = [(w.qkv, w.o, w.gate_up, w.down) for w in layers]

        def weight_set(pick) -> _Weights:  # pick(projection) -> ([(weight, type id, scales)], bias)
            out = _Weights([], [], [], [], [], [])
            for w, ps in zip(layers, projections):
                out.norms.extend((w.input_norm.weight, _mlp_norms(w)[0].weight))
                for p in ps:
                    parts, bias = pick(p)
                    out.parts.append(len(parts))
                    for weight, type_id, scales in parts:
                        out.weights.append(weight)
                        out.types.append(type_id)
                        out.scales.append(scales)
                    out.biases.append(bias)
            return out

        # kernel steps (at most max_rows rows): GGUF blocks; other steps: the dense copies
        self.kernel = weight_set(_blocks) if kernel else None
        self.dense = weight_set(lambda p: ([(_dense(p).weight, DENSE, None)], _dense(p).bias)) if dense else None
        runs = [q for ps in projections for p in ps for q in _runs(p)]
        # steps of up to max_rows rows belong to the block kernels: the kernel set's, or (no kernel
        # set: int8 activations, gguf-q8) the projections' own, op by op (weights_for: None)
        self.max_rows = min((q.max_rows for q in runs), default=0)
        self._isa = quant_kernel.ISAS[runs[0].isa] if kernel else quant_kernel.ISAS[quant_kernel.best_isa()]
        self._scale = [a.scale for a in attention]
        self._window = [a.window or 0 for a in attention]
        self._softcap = [a.softcap or 0.0 for a in attention]
        self.extra_norms = [n for w in layers for n in _extra_norms(w)]
        # the two-call halves (attn_in, attn_out_mlp) run it too: Llama arithmetic, blocks only
        self.plain = all(n is None for n in self.extra_norms) and not gelu and all(
            isinstance(p, QuantLinear) for ps in projections for p in ps)
        self._activation = int(gelu)

    @classmethod
    def for_model(cls, model) -> FusedLayers | None:
        """The fused path for `model` (an engine LlamaModel), or None where its layers need the
        op-by-op path. In fp32, Gemma's norm (x normed, times 1 + w) is Llama's arithmetic."""
        spec = model.spec
        if model.device.type != "cpu" or model.dtype != torch.float32:  # the norms' weights share the model's dtype
            return None
        projections = [p for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)]
        dense = all(_dense(p) is not None for p in projections)
        kernel = all(_runs(p) and not any(q.int8_activations for q in _runs(p)) for p in projections)
        if not (kernel or dense) or not quant_kernel.quant_kernel_available():
            return None
        s = model.shape
        return cls(model.layers, s.rms_eps, s.num_heads, s.num_kv_heads, s.head_dim, spec.attention, kernel, dense,
                   gelu=spec.activation == "gelu_tanh")

    def weights_for(self, rows: int) -> _Weights | None:
        """The weight set a step of `rows` rows runs on: the kernel's up to max_rows, else the
        dense one; None where neither applies (op by op: e.g. gguf-q8's int8 kernel steps)."""
        return self.kernel if rows <= self.max_rows else self.dense

    def layers_in_one_call(self, h: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], kv: torch.Tensor,
                           plan) -> None:
        """h [T, E] through every layer in one C++ call, attention by the CPU kernel. rope: each
        layer's (cos, sin) rows [T, R]; kv: the whole cache [L, 2, blocks, block_size, KVH, D];
        plan: the CPU attention backend's CpuPlan for this step. The step must have a weight set
        (weights_for)."""
        w = self.weights_for(h.shape[0])
        self._ops.layers(h, w.norms, w.weights, w.types, w.parts, w.biases, [c for c, _ in rope], [s for _, s in rope],
                         self.heads, self.kv_heads, self.head_dim, self.eps, self._isa, kv, plan.slot_mapping,
                         plan.tiles, plan.block_tables, self._scale, self._window, self._softcap, w.scales,
                         self.extra_norms, self._activation)

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


def _runs(p) -> list[QuantLinear]:
    """The block kernels a projection runs on: itself, a stack's parts, or none (dense)."""
    return p.parts if isinstance(p, QuantLinearStack) else [p] if isinstance(p, QuantLinear) else []


def _blocks(p) -> tuple:
    """([(blocks, type id, scales)], bias) of a projection for the kernel steps: one part, or a
    stack's, each filling its own output columns."""
    return [(q.blocks, _type_id(q), q.scales) for q in _runs(p)], p.bias


def _type_id(p: QuantLinear) -> int:
    return quant_kernel.KERNEL_TYPES[p.qtype][0]
