"""The fused layer halves (attn_in, attn_out_mlp): each equals the op-by-op arithmetic on random
GGUF blocks on every kernel path this CPU runs; a model on GGUF blocks runs its small steps
through them (with the CPU attention kernel, every layer in one `layers` call) and, with the CPU
kernel, its large steps through `layers` on the oneDNN-prepacked dense copies, as does a
dequantized model every step: all with the same logits as op by op. Layers with other
arithmetic keep the op-by-op path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.cpu_backend import CpuAttention, cpu_kernel_available
from engine.attention.torch_backend import TorchAttention
from engine.model import quant_kernel as qk
from engine.model.fused_layer import DENSE, FusedLayers
from engine.model.llama import LlamaModel
from engine.model.norm import RMSNorm
from engine.cpu import NATIVE_MAX_ROWS, kernel_max_rows
from engine.model.rope import apply_rope
from engine.model.tiny import tiny_llama
from tests.model.test_gguf_weights import write_tiny_gguf
from tests.model.test_parity import assert_greedy_parity
from tests.model.test_quant_kernel import ISAS, SCALED, random_blocks, scales_for
from tests.paged import PagedRunner

pytestmark = pytest.mark.skipif(not qk.quant_kernel_available(), reason="the C++ GGUF kernel does not build here")
OPS = torch.ops.stepwise_gguf if qk.quant_kernel_available() else None
EPS = 1e-5


def type_id(qtype: str) -> int:
    return qk.KERNEL_TYPES[qtype][0]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the order of fp32 additions: ~1e-5 of the largest value."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def dense(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return qk.dequantize(blocks, qtype, "portable")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("rotary", [32, 16])  # all of head_dim 32, or a partial rotary (Phi-3 style)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scaled", SCALED)
def test_attn_in_equals_norm_projection_rope(isa: str, rows: int, rotary: int, with_bias: bool, scaled: bool):
    heads, kv_heads, head_dim, e = 4, 2, 32, 96  # e: a multiple of the block, not of a 64-wide tile
    g = torch.Generator().manual_seed(rows + rotary)
    n = (heads + 2 * kv_heads) * head_dim
    blocks = random_blocks("Q4_1", n, e, seed=rows)
    bias = torch.randn(n, generator=g) if with_bias else None
    h, norm_w = torch.randn(rows, e, generator=g), torch.rand(e, generator=g) + 0.5
    cos, sin = torch.randn(rows, rotary, generator=g), torch.randn(rows, rotary, generator=g)

    qkv = torch.empty(rows, n)
    OPS.attn_in(h, norm_w, EPS, blocks, type_id("Q4_1"), bias, cos, sin, heads, kv_heads, head_dim, qk.ISAS[isa], qkv,
                scales_for(blocks, "Q4_1", scaled))

    want = F.linear(RMSNorm(norm_w, EPS)(h), dense(blocks, "Q4_1"), bias)
    q = want[:, : heads * head_dim].view(rows, heads, head_dim)
    k = want[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    c, s = cos[:, None, :], sin[:, None, :]
    want = torch.cat([apply_rope(q, c, s).flatten(1), apply_rope(k, c, s).flatten(1),
                      want[:, (heads + kv_heads) * head_dim :]], dim=1)
    close(qkv, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scaled", SCALED)
def test_attn_out_mlp_equals_the_op_by_op_layer_tail(isa: str, rows: int, with_bias: bool, scaled: bool):
    e, hd, inter = 96, 64, 160
    g = torch.Generator().manual_seed(rows)
    o_blocks, gu_blocks, down_blocks = (random_blocks("Q8_0", e, hd, 1), random_blocks("Q4_1", 2 * inter, e, 2),
                                        random_blocks("Q4_0", e, inter, 3))
    biases = [torch.randn(m, generator=g) if with_bias else None for m in (e, 2 * inter, e)]
    h, attn, norm_w = torch.randn(rows, e, generator=g), torch.randn(rows, hd, generator=g), torch.rand(e, generator=g) + 0.5

    got = h.clone()
    scales = [scales_for(b, t, scaled) for b, t in ((o_blocks, "Q8_0"), (gu_blocks, "Q4_1"), (down_blocks, "Q4_0"))]
    OPS.attn_out_mlp(got, attn, o_blocks, type_id("Q8_0"), biases[0], norm_w, EPS, gu_blocks, type_id("Q4_1"),
                     biases[1], down_blocks, type_id("Q4_0"), biases[2], qk.ISAS[isa], scales)

    want = h + F.linear(attn, dense(o_blocks, "Q8_0"), biases[0])
    gate, up = F.linear(RMSNorm(norm_w, EPS)(want), dense(gu_blocks, "Q4_1"), biases[1]).chunk(2, dim=-1)
    want = want + F.linear(F.silu(gate) * up, dense(down_blocks, "Q4_0"), biases[2])
    close(got, want)


def call_layers(kv: torch.Tensor, weights: list, types: list[int], parts: list[int]) -> None:
    """The `layers` op on one layer's lists (norms, biases, rotary rows of one 96-wide row)."""
    OPS.layers(torch.zeros(1, 96), [torch.ones(96)] * 2, weights, types, parts, [None] * 4, [torch.ones(1, 32)],
               [torch.ones(1, 32)], 4, 2, 32, EPS, 0, kv, torch.zeros(1, dtype=torch.long),
               torch.zeros(1, 5, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), [1.0], [0], [0.0],
               [None] * len(weights), [None] * 4, 0)


def test_layers_refuses_lists_that_do_not_cover_every_layer_or_part():
    with pytest.raises(RuntimeError, match="per-layer lists"):
        call_layers(torch.zeros(2, 2, 4, 16, 2, 32), [torch.ones(96)] * 4, [8] * 4, [1] * 4)  # kv of 2 layers
    kv = torch.zeros(1, 2, 4, 16, 2, 32)
    with pytest.raises(RuntimeError, match="one entry per part"):
        call_layers(kv, [torch.ones(96)] * 4, [8] * 4, [2, 1, 1, 1])
    with pytest.raises(RuntimeError, match="stacks 1 to 3 weights"):
        call_layers(kv, [torch.ones(96)] * 4, [8] * 4, [0, 2, 1, 1])
    qkv = [random_blocks("Q8_0", n, 96, i) for i, n in enumerate((128, 64, 64))]
    rest = [random_blocks("Q8_0", 96, 128, 3), random_blocks("Q8_0", 320, 96, 4), random_blocks("Q8_0", 96, 160, 5)]
    with pytest.raises(RuntimeError, match="one prepacked weight, not stacked"):
        call_layers(kv, qkv + rest, [8, 8, DENSE, 8, 8, 8], [3, 1, 1, 1])


def test_attn_out_mlp_refuses_shapes_that_do_not_chain():
    h, attn = torch.randn(1, 96), torch.randn(1, 64)
    o, gu, down = random_blocks("Q8_0", 96, 64, 1), random_blocks("Q8_0", 100, 96, 2), random_blocks("Q8_0", 96, 64, 3)
    with pytest.raises(RuntimeError, match="do not chain"):
        OPS.attn_out_mlp(h, attn, o, 8, None, torch.ones(96), EPS, gu, 8, None, down, 8, None, 0, [None] * 3)


def backends():
    cpu = pytest.param(CpuAttention, marks=pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel"))
    return [TorchAttention, cpu]


def one_call_rows(fused: FusedLayers) -> list[int]:
    """From now on, the rows of every step the C++ loop runs (`layers_in_one_call`)."""
    calls = []
    all_layers = fused.layers_in_one_call
    fused.layers_in_one_call = lambda *a: calls.append(a[0].shape[0]) or all_layers(*a)
    return calls


def fused_and_op_by_op(model: LlamaModel, fused: FusedLayers, steps: list, num_blocks: int,
                       kv_dtype: torch.dtype | None = None) -> tuple[list, list]:
    """The logits of `steps` (each a PagedRunner.step batch) on the fused path, then op by op,
    over a KV cache of `kv_dtype` (None: the model's); the model is left fused."""
    def run(use_fused: bool) -> list[torch.Tensor]:
        model.fused = fused if use_fused else None
        runner = PagedRunner(model, num_blocks=num_blocks, kv_dtype=kv_dtype)
        return [runner.step(batch) for batch in steps]

    got, want = run(True), run(False)
    model.fused = fused
    return got, want


@pytest.mark.parametrize("backend", backends())
def test_tiny_gguf_model_small_steps_run_fused_with_op_by_op_logits(tmp_path, backend):
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = LlamaModel(loaded.hf_model, backend(), gguf=loaded.gguf, weight_format="gguf")
    fused = model.fused
    assert isinstance(fused, FusedLayers) and fused.max_rows == NATIVE_MAX_ROWS[qk.best_isa()] >= 8
    big = fused.max_rows + 4  # a step the dense copies run (12 rows on AVX-512, 68 on AVX2)
    calls = []  # rows of each fused call: a layer half (Python loop) or every layer (C++ loop)
    attn_in, all_layers = fused.attn_in, fused.layers_in_one_call
    fused.attn_in = lambda *a: calls.append(a[1].shape[0]) or attn_in(*a)
    fused.layers_in_one_call = lambda *a: calls.append(a[0].shape[0]) or all_layers(*a)

    steps = [[(0, list(range(3, 3 + big)))],  # more rows than the kernel takes
             [(1, list(range(100, 104))), (2, list(range(120, 123))), (0, [7])]]  # a prefill mix of 8 rows
    steps += [[(0, [8 + t]), (1, [9 + t]), (2, [10 + t])] if t < 2 else [(1, [11 + t])] for t in range(4)]  # 3 rows, then 1
    got, want = fused_and_op_by_op(model, fused, steps, num_blocks=16)
    # with the CPU kernel the layer loop is one C++ call a step, the big one on the dense
    # copies; without it, kernel steps call the halves per layer and the big step is op by op
    assert calls == ([big, 8, 3, 3, 1, 1] if backend is CpuAttention else [8] * 2 + [3] * 4 + [1] * 4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_the_one_call_loop_runs_over_a_narrow_kv_cache(tmp_path, kv_dtype):
    """kv_cache_dtype float16 / bfloat16: the C++ loop stores and reads the narrow cache as the
    op-by-op path does (same logits); against a float32 cache the logits move, but only a little."""
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = LlamaModel(loaded.hf_model, CpuAttention(), gguf=loaded.gguf, weight_format="gguf")
    fused = model.fused
    calls = one_call_rows(fused)
    steps = [[(0, list(range(3, 10))), (1, list(range(100, 104)))]]  # two prompts, 11 rows
    steps += [[(0, [8 + t]), (1, [9 + t])] for t in range(3)]  # decodes over the stored rows
    got, want = fused_and_op_by_op(model, fused, steps, num_blocks=16, kv_dtype=kv_dtype)
    assert calls == [11, 2, 2, 2]
    for g, w in zip(got, want):
        close(g, w)
    runner = PagedRunner(model, num_blocks=16)  # a float32 cache
    full = [runner.step(batch) for batch in steps]
    assert not torch.equal(got[-1], full[-1])  # the rounding is real
    for g, f in zip(got, full):  # fp16: ~1e-3 here, bf16 ~2e-2 (logits up to ~4)
        torch.testing.assert_close(g, f, rtol=0, atol=0.02 * float(f.abs().max()))


def k_quant_layer(qk_type: str) -> dict:
    """A Q4_K_M (qk_type Q4_K) or Q5_K_M (Q5_K) file's layer: q/k/gate/up of that type, v and
    down Q6_K, which share no exact block type with it."""
    return {"self_attn.q_proj": ("attn_q", qk_type), "self_attn.k_proj": ("attn_k", qk_type),
            "self_attn.v_proj": ("attn_v", "Q6_K"), "self_attn.o_proj": ("attn_output", "Q8_0"),
            "mlp.gate_proj": ("ffn_gate", qk_type), "mlp.up_proj": ("ffn_up", qk_type),
            "mlp.down_proj": ("ffn_down", "Q6_K")}


@pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel")
@pytest.mark.parametrize("qk_type", ["Q3_K", "Q4_K", "Q5_K"])
def test_a_stacked_qkv_runs_each_part_on_its_blocks_in_the_one_call_loop(tmp_path, qk_type):
    """Its parts fill their own columns of qkv in the C++ loop's kernel steps (before, such a
    projection ran its fp32 dense copy there), with op-by-op logits and transformers' text.
    Q3_K and Q6_K both repack as I8: one weight, no stack."""
    hf = tiny_llama(hidden_size=256, intermediate_size=512)  # k-quants need K a multiple of 256
    loaded = write_tiny_gguf(tmp_path / "k_m.gguf", k_quant_layer(qk_type), model=hf)
    model = LlamaModel(loaded.hf_model, CpuAttention(), gguf=loaded.gguf, weight_format="gguf")
    fused = model.fused
    packed = qk.REPACKED[qk_type]  # U4, U8 or I8; Q6_K as I8
    qkv = model.layers[0].qkv
    assert [p.qtype for p in getattr(qkv, "parts", [qkv])] == ([packed] if packed == "I8" else [packed, packed, "I8"])
    assert model.layers[0].gate_up.qtype == packed and model.layers[0].down.qtype == "I8"
    assert fused.kernel.parts == [1 if packed == "I8" else 3, 1, 1, 1] * 2 and DENSE not in fused.kernel.types
    assert fused.dense.parts == [1] * 8 and set(fused.dense.types) == {DENSE}
    calls = one_call_rows(fused)
    steps = [[(0, list(range(3, 3 + fused.max_rows + 4)))]]  # the dense copies
    steps += [[(0, [7 + t]), (1, [40 + t])] if t else [(1, list(range(40, 45)))] for t in range(4)]
    got, want = fused_and_op_by_op(model, fused, steps, num_blocks=16)
    assert calls == [fused.max_rows + 4, 5, 2, 2, 2]
    for g, w in zip(got, want):
        close(g, w)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert_greedy_parity(loaded, model, loaded.tokenizer("hello world")["input_ids"])


def test_fused_weight_sets_follow_the_weight_format(tmp_path, tiny_model):
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")

    def sets(model: LlamaModel) -> tuple[bool, bool] | None:
        f = model.fused
        return None if f is None else (f.kernel is not None, f.dense is not None)

    assert sets(LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="gguf")) == (True, True)
    for fmt in ("dequantized", "gguf-q8"):  # dense weights only; int8 activations keep their own kernel op by op
        assert sets(LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format=fmt)) == (False, True)
    assert sets(LlamaModel(tiny_model.hf_model, TorchAttention())) == (False, True)  # an HF model's oneDNN weights
    assert LlamaModel(tiny_model.hf_model, TorchAttention(), linear="torch").fused is None  # plain F.linear weights
    assert LlamaModel(tiny_model.hf_model, TorchAttention(), linear="int8").fused is None


@pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel")
def test_gguf_q8_steps_of_few_rows_run_the_int8_kernel_with_the_cpu_backend(tmp_path):
    """The opt-in must not be skipped: with the CPU attention kernel, a 1-row step of a gguf-q8
    model once ran the dense fp32 copies in the one-call loop instead of the int8 kernel."""
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = LlamaModel(loaded.hf_model, CpuAttention(), gguf=loaded.gguf, weight_format="gguf-q8")
    calls, q8_calls = one_call_rows(model.fused), []
    matmul_q8 = qk.matmul_q8
    qk.matmul_q8 = lambda x, *a: q8_calls.append(x.shape[0]) or matmul_q8(x, *a)
    try:
        runner = PagedRunner(model, num_blocks=16)
        runner.step([(0, list(range(3, 40)))])  # 37 rows: the dense copies, in one call
        runner.step([(0, [5])])  # 1 row: the int8 kernel, op by op
    finally:
        qk.matmul_q8 = matmul_q8
    assert calls == [37] and q8_calls and set(q8_calls) == {1}


@pytest.mark.skipif(not cpu_kernel_available(), reason="no CPU attention kernel")
def test_dense_model_runs_every_step_in_one_call_with_op_by_op_logits(tiny_model):
    model = LlamaModel(tiny_model.hf_model, CpuAttention())
    fused = model.fused
    calls = one_call_rows(fused)
    steps = [[(0, list(range(3, 40))), (1, list(range(50, 53)))]]  # a 40-row prefill
    steps += [[(0, [8 + t]), (1, [9 + t])] for t in range(3)]  # decodes of 2 rows
    got, want = fused_and_op_by_op(model, fused, steps, num_blocks=32)
    assert calls == [40, 2, 2, 2]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_layers_refuses_a_dense_weight_that_is_not_prepacked():
    kv = torch.zeros(1, 2, 4, 16, 2, 32)
    weights = [torch.ones(256, 96), torch.ones(96, 128), torch.ones(320, 96), torch.ones(96, 160)]
    with pytest.raises(RuntimeError, match="oneDNN-prepacked"):
        call_layers(kv, weights, [DENSE] * 4, [1] * 4)


def test_small_step_rows_says_where_the_kernels_hand_over_to_the_dense_copies(tmp_path, tiny_model):
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    rows = NATIVE_MAX_ROWS[qk.best_isa()]
    assert LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="gguf").small_step_rows == rows
    q8 = LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="gguf-q8")
    # kernel steps op by op, the same switch everywhere: the int8 kernel's own (it has no panels)
    q8_rows = kernel_max_rows(qk.best_isa(), int8_activations=True)
    assert q8.fused.kernel is None and q8.small_step_rows == q8_rows <= rows
    assert q8.fused.weights_for(q8_rows) is None and q8.fused.weights_for(q8_rows + 1) is q8.fused.dense
    assert LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="dequantized").small_step_rows is None
    assert LlamaModel(tiny_model.hf_model, TorchAttention()).small_step_rows is None  # dense weights: one regime
