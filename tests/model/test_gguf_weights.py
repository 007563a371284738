"""Native GGUF weights: blocks read by HF name equal transformers' dequantized weights bit for
bit (q/k rows unpermuted), the native forward keeps greedy parity, and weight_format errors
name the tensor and type it cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize

from engine.attention.torch_backend import TorchAttention
from engine.model import quant_kernel
from engine.model.gguf_weights import QuantWeight, read_gguf_weights, rope_unpermute, to_q8_0
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel
from engine.model.quant_linear import QuantLinear, QuantLinearStack, native_weights
from engine.model.tiny import tiny_llama, tiny_tokenizer
from tests.model.test_parity import assert_greedy_parity
from tests.model.test_quant_kernel import K_QUANTS, random_blocks
from tests.paged import PagedRunner

kernel = pytest.mark.skipif(not quant_kernel.quant_kernel_available(), reason="the C++ GGUF kernel does not build here")

# tiny-model projection -> (GGUF name, type): every kernel type, and q/k permuted as llama.cpp does
TINY_TYPES = {"self_attn.q_proj": ("attn_q", "Q8_0"), "self_attn.k_proj": ("attn_k", "Q8_0"),
              "self_attn.v_proj": ("attn_v", "Q8_0"), "self_attn.o_proj": ("attn_output", "Q4_0"),
              "mlp.gate_proj": ("ffn_gate", "Q4_1"), "mlp.up_proj": ("ffn_up", "Q4_1"),
              "mlp.down_proj": ("ffn_down", "Q8_0")}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (what we must undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, types=TINY_TYPES, arch: str = "llama", model=None) -> LoadedModel:
    """A tiny Llama (`model`, or tiny_llama()) as a GGUF file, and the same model with its weights
    set to the file's dequantized values (what transformers would load from it). `arch` only
    labels the file. gguf cannot quantize to k-quants: those tensors get random blocks."""
    model = (model or tiny_llama()).eval()
    cfg = model.config
    writer = GGUFWriter(str(path), arch)
    params = dict(model.named_parameters())
    tensors = {"token_embd.weight": ("model.embed_tokens.weight", "Q8_0", None)}
    for i in range(cfg.num_hidden_layers):
        for hf, (short, qtype) in types.items():
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(short)
            tensors[f"blk.{i}.{short}.weight"] = (f"model.layers.{i}.{hf}.weight", qtype, heads)
    for gguf_name, (hf, qtype, heads) in tensors.items():
        w = params[hf].detach().numpy()
        stored = llama_cpp_permute(w, heads) if heads else w
        kind = GGMLQuantizationType[qtype]
        if qtype in K_QUANTS:  # weights of ~0.1: sub-scales to 32 (Q3_K), 63 (Q4_K, Q5_K) or 127 (Q6_K)
            seed = sum(map(ord, gguf_name))
            scale = {"Q3_K": 1e-3, "Q4_K": 1e-4, "Q5_K": 5e-5}.get(qtype, 3e-5)
            data = random_blocks(qtype, *w.shape, seed=seed, scale=scale).numpy()
        else:
            data = quantize(stored, kind) if qtype != "F16" else stored.astype(np.float16)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        back = dequantize(data, kind).astype(np.float32).reshape(w.shape)
        if heads:
            back = back[rope_unpermute(w.shape[0], heads).numpy()]
        with torch.no_grad():
            params[hf].copy_(torch.from_numpy(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return LoadedModel(model, tiny_tokenizer(), "tiny-gguf", path)


def test_rope_unpermute_undoes_llama_cpp_permute():
    w = np.arange(48 * 3).reshape(48, 3)
    for heads in (1, 2, 4):
        got = llama_cpp_permute(w, heads)[rope_unpermute(48, heads).numpy()]
        np.testing.assert_array_equal(got, w)


@kernel
def test_tiny_gguf_blocks_equal_the_dequantized_weights(tmp_path):
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    cfg = loaded.hf_model.config
    found = read_gguf_weights(loaded.gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
    params = dict(loaded.hf_model.named_parameters(remove_duplicate=False))
    assert set(found.runnable) == set(params) - {n for n in params if "norm" in n} and not found.other
    for name, w in found.runnable.items():
        torch.testing.assert_close(quant_kernel.dequantize(w.blocks, w.qtype), params[name].detach(), rtol=0, atol=0)


@kernel
def test_tiny_gguf_native_greedy_matches_hf_and_dense(tmp_path):
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    native = LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="gguf")
    assert native.weight_format == "gguf"
    assert all(isinstance(p, QuantLinear) for p in (native.lm_head, native.layers[0].qkv, native.layers[1].down))
    assert native.layers[0].o.qtype == "Q4_0" and native.layers[0].gate_up.qtype == "Q4_1"
    # tokens are looked up in the embedding's Q8_0 blocks (no fp32 table kept), bit for bit
    assert native.embed.table is None and native.embed.blocks.qtype == "Q8_0"
    ids = torch.tensor([5, 0, 17, 5, 255])
    assert torch.equal(native.embed(ids), loaded.hf_model.model.embed_tokens(ids))
    for text in ("hello world", "The quick brown fox"):
        assert_greedy_parity(loaded, native, loaded.tokenizer(text)["input_ids"])
    dense = LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="dequantized")
    assert dense.weight_format == "dequantized" and dense.embed.blocks is None
    prompt = list(range(3, 12))
    # one token at a time: every step runs the block kernel
    assert PagedRunner(native, num_blocks=8).greedy(0, prompt, 12) == PagedRunner(dense, num_blocks=8).greedy(0, prompt, 12)


def test_kernel_row_threshold_follows_the_kernel_path():
    blocks = [QuantWeight(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0", "w")]
    assert QuantLinear(blocks, None, None, isa="avx512").max_rows == 8  # oneDNN overtakes earlier there
    assert QuantLinear(blocks, None, None, isa="avx2").max_rows == 64  # the outer-product panels hold out longer
    assert QuantLinear(blocks, None, None, isa="avx2", int8_activations=True).max_rows == 16  # the int8 kernel's own
    assert QuantLinear(blocks, None, None, isa="avx512", int8_activations=True).max_rows == 8
    assert QuantLinear(blocks, None, None, isa="portable", max_rows=3).max_rows == 3


@kernel
def test_a_type_without_kernel_is_named_or_runs_dequantized(tmp_path, capsys):
    types = dict(TINY_TYPES, **{"self_attn.k_proj": ("attn_k", "F16")})
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf", types)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"blk\.\d\.attn_k\.weight is F16"):
        native_weights(loaded.hf_model, loaded.gguf, "gguf", cpu, torch.float32, "onednn")
    auto = LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf)
    assert "F16 x2" in capsys.readouterr().err  # says which weights run dequantized
    assert not isinstance(auto.layers[0].qkv, QuantLinear)  # k is F16: the fused qkv is dense
    assert isinstance(auto.layers[0].gate_up, QuantLinear)
    assert_greedy_parity(loaded, auto, loaded.tokenizer("hello world")["input_ids"])


@kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0"])
def test_to_q8_0_keeps_every_weight(qtype):
    w = torch.randn(7, 96)
    blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype]))
    q8 = to_q8_0(QuantWeight(blocks, qtype, "w"))
    assert q8.qtype == "Q8_0" and q8.blocks.shape == (7, 3 * 34)
    assert torch.equal(quant_kernel.dequantize(q8.blocks, "Q8_0"), quant_kernel.dequantize(blocks, qtype))
    with pytest.raises(ValueError, match="Q4_1 has no exact Q8_0 form"):
        to_q8_0(QuantWeight(torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_1)), "Q4_1", "w"))


@kernel
@pytest.mark.parametrize("v_type,fused", [("Q8_0", "Q8_0"), ("Q4_1", None)])
def test_a_fused_projection_of_two_types_keeps_parity(tmp_path, v_type, fused):
    """Q5_0 q/k (as Q4_K_M files mix them) with a Q8_0 v: one Q8_0 weight, exactly; with a Q4_1
    v (no exact common type): each part on its own kernel, outputs stacked."""
    types = dict(TINY_TYPES, **{"self_attn.q_proj": ("attn_q", "Q5_0"), "self_attn.k_proj": ("attn_k", "Q5_0"),
                                "self_attn.v_proj": ("attn_v", v_type),
                                "mlp.gate_proj": ("ffn_gate", "Q5_0"), "mlp.up_proj": ("ffn_up", "Q5_0")})
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf", types)
    native = LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf, weight_format="gguf")
    qkv = native.layers[0].qkv
    if fused:
        assert isinstance(qkv, QuantLinear) and qkv.qtype == fused
    else:
        assert isinstance(qkv, QuantLinearStack) and [p.qtype for p in qkv.parts] == ["Q5_0", "Q5_0", "Q4_1"]
    assert native.layers[0].gate_up.qtype == "Q5_0"
    for text in ("hello world", "The quick brown fox"):
        assert_greedy_parity(loaded, native, loaded.tokenizer(text)["input_ids"])
    # the int8-activation kernel runs Q4_0, Q4_1, Q8_0 only: Q5_0 is named, or runs dequantized
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"'gguf-q8': tensor blk\.\d\.attn_q\.weight is Q5_0"):
        native_weights(loaded.hf_model, loaded.gguf, "gguf-q8", cpu, torch.float32, "onednn")
    every = native_weights(loaded.hf_model, loaded.gguf, "auto", cpu, torch.float32, "onednn")
    assert {w.qtype for w in every.values()} == {"Q5_0", "Q8_0", "Q4_0", v_type}  # "auto": the fp32 kernel's types


@kernel
def test_an_architecture_without_native_path_runs_dequantized_under_auto(tmp_path, capsys):
    loaded = write_tiny_gguf(tmp_path / "tiny.gguf", arch="phi3")  # fused qkv / gate_up: no 1:1 map
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"weight_format 'gguf': tiny\.gguf: GGUF architecture 'phi3' has no native path"):
        native_weights(loaded.hf_model, loaded.gguf, "gguf", cpu, torch.float32, "onednn")
    auto = LlamaModel(loaded.hf_model, TorchAttention(), gguf=loaded.gguf)
    assert auto.weight_format == "dequantized" and not isinstance(auto.lm_head, QuantLinear)
    assert "'phi3' has no native path" in capsys.readouterr().err  # the log line says why
    assert_greedy_parity(loaded, auto, loaded.tokenizer("hello world")["input_ids"])


def test_gguf_format_needs_a_gguf_model_on_cpu_float32(tiny_model):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        native_weights(tiny_model.hf_model, None, "gguf", cpu, torch.float32, "onednn")
    assert native_weights(tiny_model.hf_model, None, "auto", cpu, torch.float32, "onednn") is None
    with pytest.raises(ValueError, match="float32"):
        native_weights(tiny_model.hf_model, tiny_model.gguf or "x.gguf", "gguf", cpu, torch.bfloat16, "torch")
    with pytest.raises(ValueError, match="unknown weight_format"):
        native_weights(tiny_model.hf_model, None, "q4", cpu, torch.float32, "onednn")


@pytest.mark.real_model
@kernel
def test_real_blocks_equal_transformers_weights(real_model):
    cfg = real_model.hf_model.config
    found = read_gguf_weights(real_model.gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
    params = dict(real_model.hf_model.named_parameters(remove_duplicate=False))
    assert not found.other and len(found.runnable) == 30 * 7 + 2  # projections, embedding, tied head
    assert {w.qtype for w in found.runnable.values()} == {"Q4_1", "Q8_0"}
    for name, w in found.runnable.items():
        assert torch.equal(quant_kernel.dequantize(w.blocks, w.qtype), params[name].detach()), name


@pytest.mark.real_model
def test_real_model_runs_native_by_default(ours):
    assert ours.weight_format == ("gguf" if quant_kernel.quant_kernel_available() else "dequantized")
