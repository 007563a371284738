"""What our forward needs to know about a model, read from its transformers config.

The supported families differ from Llama in a few composable details; `ModelSpec` names each
one, derived from the config, so the forward (engine/model/llama.py) stays one code path:

| family | differences from Llama |
|---|---|
| Llama 3.x | RoPE scaling `llama3` / `linear` / `yarn` (the model's own rotary tables) |
| Mistral | sliding window on every layer when `sliding_window` is set |
| Qwen2 / Qwen2.5 | bias on q/k/v (taken from the weights, as any projection's bias) |
| Qwen3 | per-head RMSNorm on q and k before RoPE; explicit `head_dim` |
| Gemma 2 | (1 + w) RMSNorm, √hidden embedding scale, norms around attention and MLP, GeGLU (tanh), `query_pre_attn_scalar`, attention and final logit soft-caps, alternating sliding/global layers |
| Gemma 3 | as Gemma 2 with q/k norm and a RoPE base per layer type (local / global), no attention soft-cap |
| Phi-3 | fused `qkv_proj` / `gate_up_proj` (taken as they are), partial rotary |

Anything else a config asks for that the forward does not implement is refused with a
`ValueError` naming the field: dynamic or long-context RoPE (`dynamic`, `longrope`), unknown
layer types, bidirectional attention (`use_bidirectional_attention`, `is_causal: false`), a
config nested under `text_config` or with a `per_layer_config`, activations other than SiLU / tanh-GELU, a
`sliding_window` on Llama or an `attention_chunk_size` on any family (transformers' `generate`
slides its cache by them, though its forward does not) shorter than the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.attention.backend import LayerAttention

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Where transformers applies `sliding_window`: on every layer, or on the `layer_types` marked
# sliding (Llama has no window at all).
WINDOW_ON_EVERY_LAYER = ("MistralForCausalLM", "Phi3ForCausalLM")
WINDOW_BY_LAYER_TYPE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *GEMMA)
# RoPE types whose tables depend on the position only (not on the sequence's length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}  # swish = SiLU


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


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    shape: ModelShape
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    gemma_norms: bool  # (1 + w) RMSNorm in fp32; norms after attention and around the MLP
    final_softcap: float | None  # logits -> cap * tanh(logits / cap)
    attention: tuple[LayerAttention, ...]  # per layer: scale, sliding window, soft-cap
    rope_keys: tuple[str, ...]  # per layer: which rotary table ("all", or the layer type)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(a.window for a in self.attention)


def spec_from_config(config, architecture: str) -> ModelSpec:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    # read from vars: a per-layer config (transformers keeps it as _heterogeneity_spec) raises on
    # any attribute that may vary per layer
    for key, attr, what in (("text_config", "text_config", "a multimodal model's config (the language model's keys "
                                                             "nested under it)"),
                            ("per_layer_config", "_heterogeneity_spec", "settings that differ per layer")):
        if vars(config).get(attr) is not None:
            raise ValueError(f"unsupported: {key}, {what}; only one decoder's flat config is served")
    gemma = architecture in GEMMA
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = ModelShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
        rms_eps=config.rms_norm_eps,
    )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("unsupported: use_bidirectional_attention=True (only causal decoders)")
    if getattr(config, "is_causal", True) is False:  # transformers' masks turn bidirectional for any family
        raise ValueError("unsupported: is_causal=False (only causal decoders)")
    act_name = config.hidden_activation if gemma else config.hidden_act
    if act_name not in ACTIVATIONS:
        raise ValueError(f"unsupported {'hidden_activation' if gemma else 'hidden_act'} {act_name!r}; "
                         f"supported: {', '.join(ACTIVATIONS)}")
    _check_rope(config)
    scale = config.query_pre_attn_scalar**-0.5 if gemma else head_dim**-0.5
    softcap = getattr(config, "attn_logit_softcapping", None) if gemma else None
    if softcap is not None and architecture == "Gemma3ForCausalLM":
        # Gemma 3 has q/k norms instead; its transformers attention keeps the field but never applies it
        raise ValueError(f"unsupported attn_logit_softcapping {softcap} on Gemma 3: transformers' Gemma 3 "
                         "attention does not apply it (Gemma 2's does); set it to null")
    windows, keys = _layer_windows(config, architecture)
    return ModelSpec(
        architecture=architecture,
        shape=shape,
        activation=ACTIVATIONS[act_name],
        gemma_norms=gemma,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        attention=tuple(LayerAttention(scale, w, softcap) for w in windows),
        rope_keys=keys if architecture == "Gemma3ForCausalLM" else ("all",) * shape.num_layers,
    )


def _layer_windows(config, architecture: str) -> tuple[list[int | None], tuple[str, ...]]:
    """Per layer: the sliding window (None = global) and the layer type."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    def bites(field: str) -> bool:  # set, and shorter than the context
        return (getattr(config, field, None) or config.max_position_embeddings) < config.max_position_embeddings

    if bites("attention_chunk_size"):
        raise ValueError(f"unsupported attention_chunk_size {config.attention_chunk_size} (chunked local attention)")
    if architecture not in WINDOW_BY_LAYER_TYPE:
        if architecture not in WINDOW_ON_EVERY_LAYER and bites("sliding_window"):
            raise ValueError(f"unsupported sliding_window {window} on {architecture}: this family's layers attend "
                             "to the whole context here, while transformers' generate would slide its cache")
        window = window if architecture in WINDOW_ON_EVERY_LAYER else None
        return [window] * n, ("full_attention",) * n
    types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * n)
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"unsupported layer_types {list(types)!r}; each must be one of {LAYER_TYPES}")
    if "sliding_attention" in types and window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    return [window if t == "sliding_attention" else None for t in types], types


def _check_rope(config) -> None:
    params = getattr(config, "rope_parameters", None) or {}
    # Gemma 3 keeps one set per layer type; the others one set.
    sets = params.items() if all(isinstance(v, dict) for v in params.values()) and params else [("", params)]
    for where, p in sets:
        rope_type = (p or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            field = f"rope_parameters[{where!r}].rope_type" if where else "rope_parameters.rope_type (rope_scaling)"
            raise ValueError(f"unsupported {field} {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)} "
                             "(dynamic and long-context RoPE depend on the sequence's length)")
