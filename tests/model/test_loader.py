"""Model loading: clear errors, a local Hugging Face directory, the GGUF conversion cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttention
from engine.config import EngineConfig
from engine.model.llama import LlamaModel
from engine.model.loader import ModelLoadError, convert_gguf, load_model, locate_wheel_gguf
from tests.paged import PagedRunner

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_missing_path_names_what_was_tried(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as err:
        load_model(str(missing), tmp_path / "cache")
    msg = str(err.value)
    assert str(missing) in msg
    assert "smollm2-135m" in msg and "tiny-random" in msg
    assert ".gguf" in msg and "Hugging Face directory" in msg


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), tmp_path / "cache")


def test_unsupported_architecture(tmp_path):
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(model_dir), tmp_path / "cache")
    msg = str(err.value)
    assert "unsupported architecture" in msg and "GPT2LMHeadModel" in msg
    assert "LlamaForCausalLM" in msg  # says what is supported


def test_local_hf_directory_round_trip(tmp_path, tiny_model, tiny_ours):
    tiny_model.hf_model.save_pretrained(tmp_path)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), tmp_path / "cache")
    assert loaded.name == tmp_path.name
    for name, tensor in tiny_model.hf_model.state_dict().items():
        torch.testing.assert_close(loaded.hf_model.state_dict()[name], tensor, atol=0, rtol=0, msg=name)

    text = "round trip: 你好"
    assert loaded.tokenizer(text)["input_ids"] == tiny_model.tokenizer(text)["input_ids"]
    prompt = loaded.tokenizer(text)["input_ids"]
    reloaded = LlamaModel(loaded.hf_model, TorchAttention())
    got = PagedRunner(reloaded, num_blocks=8).step([(0, prompt)])
    want = PagedRunner(tiny_ours, num_blocks=8).step([(0, prompt)])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with torch.inference_mode():
        hf = loaded.hf_model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(got[0], hf, atol=1e-4, rtol=1e-4)


def _saved(tiny_model, where: Path, edit_config=None, edit_weights=None) -> Path:
    """The tiny model saved as a Hugging Face directory, its config.json or weights edited."""
    from safetensors.torch import load_file, save_file

    tiny_model.hf_model.save_pretrained(where)
    tiny_model.tokenizer.save_pretrained(where)
    if edit_config:
        config = json.loads((where / "config.json").read_text())
        edit_config(config)
        (where / "config.json").write_text(json.dumps(config))
    if edit_weights:
        weights = where / "model.safetensors"
        state = load_file(weights)
        edit_weights(state)
        save_file(state, weights, metadata={"format": "pt"})
    return where


def test_a_checkpoint_missing_a_tensor_is_refused_not_filled_at_random(tmp_path, tiny_model):
    path = _saved(tiny_model, tmp_path / "m", edit_weights=lambda st: st.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks tensors .*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(path), tmp_path / "cache")


def test_a_checkpoint_with_tensors_the_config_has_no_place_for_is_refused(tmp_path, tiny_model):
    # biases in the file, attention_bias false in config.json: transformers would drop them
    def add_biases(state):
        for i in range(tiny_model.hf_model.config.num_hidden_layers):
            state[f"model.layers.{i}.self_attn.q_proj.bias"] = torch.ones(tiny_model.hf_model.config.hidden_size)

    path = _saved(tiny_model, tmp_path / "m", edit_weights=add_biases)
    with pytest.raises(ModelLoadError, match=r"no place for .*q_proj\.bias"):
        load_model(str(path), tmp_path / "cache")


def test_a_config_without_architectures_is_the_causal_lm_of_its_model_type(tmp_path, tiny_model):
    path = _saved(tiny_model, tmp_path / "m", edit_config=lambda c: c.pop("architectures"))
    assert type(load_model(str(path), tmp_path / "cache").hf_model).__name__ == "LlamaForCausalLM"


def test_a_config_transformers_refuses_is_a_load_error_naming_the_file(tmp_path):
    # Phi-3 takes only longrope scaling: huggingface_hub's validation error, which is no ValueError
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                                                      "rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match="cannot read config.json.*longrope"):
        load_model(str(tmp_path), tmp_path / "cache")


@pytest.mark.real_model
def test_gguf_conversion_is_cached(real_model):
    # real_model has converted (or found) the GGUF in the shared cache dir already.
    cache_dir = EngineConfig.load(REPO_ROOT / "config.toml").model.resolved_cache_dir()
    gguf = locate_wheel_gguf("smollm2-135m", cache_dir)
    first = convert_gguf(gguf, cache_dir)
    assert (first / "done").is_file() and (first / "config.json").is_file()
    weights = first / "model.safetensors"
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    second = convert_gguf(gguf, cache_dir)

    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == mtimes  # nothing rewritten: not reconverted
    assert weights.stat().st_size > 100_000_000  # dequantized fp32 weights, not a stub
    assert not list(first.parent.glob(first.name + ".*tmp"))


def test_conversion_cache_hit_skips_reconversion(tmp_path, monkeypatch, tiny_model):
    """With the dequantizer stubbed out: the first call converts, the second only finds the
    `done` marker; the same bytes at another path (another venv's wheel) or with a new mtime
    share it; changed bytes get a fresh directory."""
    import engine.model.loader as loader

    calls = []

    def fake_model(*args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        return tiny_model.hf_model

    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_model.tokenizer)
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF not really")
    cache = tmp_path / "cache"

    first = convert_gguf(gguf, cache)
    assert calls == ["fake.gguf"]
    assert (first / "done").is_file() and first.parent == cache
    marker_mtime = (first / "done").stat().st_mtime_ns

    assert convert_gguf(gguf, cache) == first
    assert calls == ["fake.gguf"], "cache hit must not reconvert"
    assert (first / "done").stat().st_mtime_ns == marker_mtime

    # A half-finished conversion (no `done`) is redone, not trusted.
    (first / "done").unlink()
    assert convert_gguf(gguf, cache) == first
    assert len(calls) == 2 and (first / "done").is_file()

    elsewhere = tmp_path / "venv2" / "fake.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(gguf.read_bytes())
    assert convert_gguf(elsewhere, cache) == first
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert convert_gguf(gguf, cache) == first and len(calls) == 2

    renamed = tmp_path / "renamed.gguf"  # the same bytes under another name: no second conversion
    renamed.write_bytes(gguf.read_bytes())
    assert convert_gguf(renamed, cache) == first and len(calls) == 2

    gguf.write_bytes(b"GGUF changed")
    third = convert_gguf(gguf, cache)
    assert third != first and third.name.startswith("fake-") and len(calls) == 3

    # The converted directory loads (real from_pretrained) as a plain HF directory, same weights.
    monkeypatch.undo()
    loaded = load_model(str(first), tmp_path / "unused")
    for name, tensor in tiny_model.hf_model.state_dict().items():
        torch.testing.assert_close(loaded.hf_model.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_a_model_larger_than_the_free_memory_is_refused_before_loading(tmp_path, tiny_model, monkeypatch):
    """Its weights alone would not fit: a ModelLoadError naming the model and the sizes, not the
    OOM killer's SIGKILL half-way through transformers' load or GGUF conversion."""
    from engine import memory
    from tests.model.test_gguf_weights import write_tiny_gguf

    tiny_model.hf_model.save_pretrained(tmp_path / "hf")
    tiny_model.tokenizer.save_pretrained(tmp_path / "hf")
    params = sum(p.numel() for p in tiny_model.hf_model.parameters())
    monkeypatch.setattr(memory, "available_bytes", lambda device: params * 4 - 1)
    with pytest.raises(ModelLoadError, match=r"hf: its 0.00 B parameters take 0.0 GiB in float32 as transformers loads "
                                             r"them, but only 0.0 GiB of memory is free"):
        load_model(str(tmp_path / "hf"), tmp_path / "cache")
    assert load_model(str(tmp_path / "hf"), tmp_path / "cache", torch.bfloat16).hf_model.dtype == torch.bfloat16  # fits
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1)
    with pytest.raises(ModelLoadError, match="tiny.gguf: its .* in float32 while transformers dequantizes the file"):
        load_model(str(tmp_path / "tiny.gguf"), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("tiny-*"))  # refused before the conversion began


def test_an_unsupported_gguf_architecture_is_refused_before_conversion(tmp_path):
    """A GPT-2 file used to fail deep in transformers ("ignore_mismatched_sizes"), naming neither
    gpt2 nor "unsupported"; a StableLM one was refused only after a full conversion."""
    from tests.model.test_gguf_weights import write_tiny_gguf

    write_tiny_gguf(tmp_path / "other.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="other.gguf: unsupported GGUF architecture 'gpt2'; supported: llama, "):
        load_model(str(tmp_path / "other.gguf"), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("other-*"))


def test_conversions_racing_each_other_both_end_with_the_first_finished(tmp_path, monkeypatch, tiny_model):
    """Two replicas starting at once on a fresh machine both convert: each writes its own
    directory, and the one that finishes second keeps the first's (it used to delete the other's
    half-written directory, failing that replica's start). An abandoned one is cleaned up."""
    import engine.model.loader as loader

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF not really")
    cache = tmp_path / "cache"
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_model.tokenizer)
    target = cache / f"fake-{loader._content_key(gguf, cache)}"
    abandoned = target.with_name(f"{target.name}.999999999.tmp")  # no such pid
    abandoned.mkdir(parents=True)
    racing = []

    def the_other_replica_finishes_meanwhile(*args, **kwargs):
        racing.append(sorted(p.name for p in cache.glob("fake-*")))
        target.mkdir()
        (target / "done").write_text("ok\n")
        (target / "theirs").write_text("")
        return tiny_model.hf_model

    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", the_other_replica_finishes_meanwhile)
    assert convert_gguf(gguf, cache) == target
    assert racing == [[f"{target.name}.{os.getpid()}.tmp"]]  # its own directory; the abandoned one is gone
    assert (target / "theirs").exists()  # the first finished conversion stays
    assert sorted(p.name for p in cache.glob("fake-*")) == [target.name]  # nothing left over


@pytest.mark.parametrize("cut", [None, 200])  # whole, or cut inside its header (an IndexError in gguf's reader)
def test_a_failed_conversion_is_a_load_error_and_leaves_nothing_behind(tmp_path, cut):
    from tests.model.test_gguf_weights import write_tiny_gguf

    write_tiny_gguf(tmp_path / "notok.gguf")  # a llama file with no tokenizer in it
    if cut:
        (tmp_path / "notok.gguf").write_bytes((tmp_path / "notok.gguf").read_bytes()[:cut])
    with pytest.raises(ModelLoadError, match="notok.gguf: could not be converted through transformers' GGUF loader"):
        load_model(str(tmp_path / "notok.gguf"), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("notok-*"))  # no half-written .tmp directory


def _header_only_gguf(path: Path, arch: str, keys: dict, tensors: tuple[str, ...] = ()) -> Path:
    """A GGUF with `keys` and small `tensors`: enough for the header check, which runs before
    transformers reads the file."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_key_value(key, *value)
    for name in ("token_embd.weight", *tensors):
        writer.add_tensor(name, np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_cases():
    from gguf import GGUFValueType as T

    return {  # transformers' GGUF loader drops each of these (session 25 audit): plain RoPE, default caps
        "llama-linear": ("llama", {"llama.rope.scaling.type": ("linear", T.STRING),
                                   "llama.rope.scaling.factor": (4.0, T.FLOAT32)}, (),
                         "llama.rope.scaling.factor = 4 (llama.rope.scaling.type = 'linear')"),
        "llama3-rope-freqs": ("llama", {}, ("rope_freqs.weight",), "rope_freqs.weight"),
        # llama.cpp scales linearly by a factor without a type, or by the older key (review)
        "llama-factor-only": ("llama", {"llama.rope.scaling.factor": (4.0, T.FLOAT32)}, (),
                              "llama.rope.scaling.factor = 4 (linear scaling"),
        "llama-scale-linear": ("llama", {"llama.rope.scale_linear": (2.0, T.FLOAT32)}, (),
                               "llama.rope.scale_linear = 2 (linear scaling"),
        "qwen2-yarn": ("qwen2", {"qwen2.rope.scaling.type": ("yarn", T.STRING)}, (), "qwen2.rope.scaling.type = 'yarn'"),
        "phi3-longrope": ("phi3", {}, ("rope_factors_long.weight", "rope_factors_short.weight"),
                          "rope_factors_long.weight; rope_factors_short.weight"),
        "gemma2-softcap": ("gemma2", {"gemma2.final_logit_softcapping": (20.0, T.FLOAT32)}, (),
                           "gemma2.final_logit_softcapping = 20.0"),
        "gemma2-27b-scale": ("gemma2", {"gemma2.attention.key_length": (128, T.UINT32)}, (),
                             "gemma2.attention.key_length = 128"),
    }


@pytest.mark.parametrize("case", ["llama-linear", "llama3-rope-freqs", "llama-factor-only", "llama-scale-linear", "qwen2-yarn", "phi3-longrope", "gemma2-softcap",
                                  "gemma2-27b-scale"])
def test_a_gguf_saying_what_transformers_drops_is_refused(tmp_path, case):
    """transformers' GGUF loader read none of these, so the file loaded and ran plain RoPE
    (a 120-token prompt's argmax changed) or other scales than llama.cpp runs it with."""
    arch, keys, tensors, named = _gguf_cases()[case]
    gguf = _header_only_gguf(tmp_path / f"{case}.gguf", arch, keys, tensors)
    with pytest.raises(ModelLoadError, match="GGUF loader would drop") as e:
        convert_gguf(gguf, tmp_path / "cache")
    assert named in str(e.value)
    assert not list((tmp_path / "cache").glob(f"{case}-*"))  # refused before converting


def test_a_conversion_cached_before_the_header_check_is_checked_once(tmp_path):
    from gguf import GGUFValueType as T

    from engine.model.loader import CHECKED, HEADER_CHECK, _content_key

    cache = tmp_path / "cache"
    for name, keys, refused, marker in (("scaled", {"llama.rope.scaling.type": ("yarn", T.STRING)}, True, None),
                                        ("older", {"llama.rope.scaling.type": ("yarn", T.STRING)}, True, "1\n"),
                                        ("plain", {"llama.rope.scaling.type": ("none", T.STRING),
                                                   "general.description": (b"\xff\xfe", T.STRING)}, False, None)):
        gguf = _header_only_gguf(tmp_path / f"{name}.gguf", "llama", keys)
        old = cache / f"{name}-{_content_key(gguf, cache)}"
        old.mkdir(parents=True)
        (old / "done").write_text("ok\n")  # an older session's conversion, checked by an older check or none
        if marker is not None:
            (old / CHECKED).write_text(marker)
        if refused:
            with pytest.raises(ModelLoadError, match="rope.scaling.type"):
                convert_gguf(gguf, cache)
        else:  # a string that is not UTF-8 in a field nobody reads (it raised UnicodeDecodeError)
            assert convert_gguf(gguf, cache) == old and (old / CHECKED).read_text() == HEADER_CHECK
