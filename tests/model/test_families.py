"""Every supported family against transformers, through the normal loader path.

Per family (tests/model/families.py: a tiny random model with the family's real features on —
sliding window shorter than the prompts, soft-caps, q/k norms, biases, llama3 RoPE scaling,
fused projections), saved to a Hugging Face directory and loaded with `load_model`:
- next-token logits equal transformers' forward (fp32, 1e-4), prefilled whole and in chunks
  smaller than the sliding window, on the `torch` and `cpu` attention backends;
- 32 greedy tokens per prompt equal `generate(do_sample=False)` through the Engine under
  static, continuous and chunked batching (chunks of 16 < window 24, prompts crossing it),
  four requests in flight at once.
Plus: stop tokens from generation_config.json end generation, and configs asking for what we
do not implement are refused before any weight is read.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Phi3Config, Qwen2Config

from engine import Engine, SamplingParams
from engine.attention.torch_backend import TorchAttention
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, ModelLoadError, load_model
from tests.engine.util import POLICIES, StepRecorder, greedy, run_all, tiny_config
from engine.model.tiny import tiny_tokenizer
from tests.model.families import COMMON, FAMILIES, WINDOW, build, save
from tests.paged import PagedRunner

TEXT = "The quick brown fox jumps over the lazy dog; 敏捷的棕色狐狸跳过了懒狗。 Pack my box with five dozen jugs. "
PROMPT_LENS = [9, 30, 47, 61]  # 47, 61 > window 24
NEW_TOKENS = 32
CHUNKED = {"max_num_batched_tokens": 32, "chunk_size": 16, "max_step_ms": 0}  # token budget: chunks of exactly chunk_size


def backends():
    from engine.attention.cpu_backend import CpuAttention, cpu_kernel_available

    return [TorchAttention()] + ([CpuAttention()] if cpu_kernel_available() else [])


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, LoadedModel, list[list[int]]]:
    path = save(request.param, tmp_path_factory.mktemp(request.param))
    loaded = load_model(str(path), tmp_path_factory.mktemp("cache"))
    ids = loaded.tokenizer.encode(TEXT * 2, add_special_tokens=False)
    return request.param, loaded, [ids[:n] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_greedy(family) -> list[list[int]]:
    """transformers' generate, each prompt alone; it stops at any generation_config EOS."""
    _, loaded, prompts = family
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = loaded.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def test_loaded_as_its_family(family):
    name, loaded, _ = family
    model = LlamaModel(loaded.hf_model, TorchAttention())
    assert type(loaded.hf_model).__name__ == model.spec.architecture
    windows = model.spec.windows
    if name in ("mistral", "phi3"):
        assert windows == (WINDOW,) * len(windows)
    elif name in ("qwen2", "gemma2", "gemma3"):
        assert WINDOW in windows and None in windows  # sliding and global layers
    else:
        assert set(windows) == {None}


@pytest.mark.parametrize("chunk", [None, 16, 7], ids=["whole", "chunk16", "chunk7"])
def test_logits_match_transformers_forward(family, chunk):
    _, loaded, prompts = family
    prompt = prompts[-1]  # 61 tokens, window 24
    with torch.inference_mode():
        want = loaded.hf_model(torch.tensor([prompt])).logits[0, -1].float()
    for backend in backends():
        model = LlamaModel(loaded.hf_model, backend)
        if backend.name == "cpu":  # every family's layer loop runs in one C++ call there (dense fp32 weights)
            assert model.fused is not None and model.fused.dense is not None
        runner = PagedRunner(model, num_blocks=16)
        step = chunk or len(prompt)
        for i in range(0, len(prompt), step):
            got = runner.step([(0, prompt[i : i + step])])[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{backend.name}: {m}")


def test_yarn_rope_logits_match_transformers(tmp_path):
    """Qwen2.5 / Llama long-context checkpoints ask for YaRN: static tables with an attention
    factor, taken from transformers' rotary module; a prompt past the original context."""
    model = build("llama3")
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 32}
    model.save_pretrained(tmp_path / "yarn")
    tiny_tokenizer().save_pretrained(tmp_path / "yarn")
    loaded = load_model(str(tmp_path / "yarn"), tmp_path / "cache")
    assert loaded.hf_model.model.rotary_emb.attention_scaling != 1.0
    prompt = loaded.tokenizer.encode(TEXT * 2, add_special_tokens=False)[:100]
    with torch.inference_mode():
        want = loaded.hf_model(torch.tensor([prompt])).logits[0, -1]
    got = PagedRunner(LlamaModel(loaded.hf_model, TorchAttention()), num_blocks=16).step([(0, prompt)])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_swish_is_silu(tmp_path):
    """transformers' ACT2FN maps "swish" to SiLU, as some configs name it."""
    model = build("llama3")
    model.config.hidden_act = "swish"
    model.save_pretrained(tmp_path / "swish")
    tiny_tokenizer().save_pretrained(tmp_path / "swish")
    loaded = load_model(str(tmp_path / "swish"), tmp_path / "cache")
    prompt = loaded.tokenizer.encode(TEXT, add_special_tokens=False)[:40]
    with torch.inference_mode():
        want = loaded.hf_model(torch.tensor([prompt])).logits[0, -1]
    ours = LlamaModel(loaded.hf_model, TorchAttention())
    assert ours.spec.activation == "silu"
    torch.testing.assert_close(PagedRunner(ours, num_blocks=16).step([(0, prompt)])[0], want, atol=1e-4, rtol=1e-4)


def _up_to_stop(tokens: list[int], stop: frozenset[int]) -> list[int]:
    """generate stops at an EOS; with ignore_eos the engine goes on."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stop), tokens)


@pytest.mark.parametrize("policy", POLICIES)
def test_engine_greedy_equals_generate(family, hf_greedy, policy):
    _, loaded, prompts = family
    extra = CHUNKED if policy == "chunked" else {"batch_timeout_ms": 5000} if policy == "static" else {}

    async def run():
        cfg = tiny_config(model="unused: loaded is given", policy=policy, max_num_seqs=len(prompts), **extra)
        async with Engine(cfg, loaded=loaded) as engine:
            recorder = await StepRecorder(engine).start()
            results = await run_all(engine, prompts, [greedy(NEW_TOKENS)] * len(prompts))
            records = await recorder.caught_up()
            recorder.stop()
        return results, records

    results, records = asyncio.run(run())
    assert max(len({i.request_id for i in r.items}) for r in records) == len(prompts)  # all in flight together
    if policy == "chunked":
        assert all(it.num_tokens <= 16 for r in records for it in r.items)
    for prompt, result, want in zip(prompts, results, hf_greedy):
        assert len(result.token_ids) == NEW_TOKENS
        got = _up_to_stop(result.token_ids, loaded.eos_token_ids)
        assert got == want, f"{policy}, {len(prompt)}-token prompt: first divergence at " \
                            f"{next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)}"


def test_generation_config_stop_tokens_end_generation(tmp_path):
    """Llama 3 style: generation_config.json lists several EOS ids; any of them stops a request."""
    path = save("llama3", tmp_path / "llama3")
    loaded = load_model(str(path), tmp_path / "cache")
    assert loaded.eos_token_ids == {1, 2}  # [2, 1] from the config, 2 also the tokenizer's
    prompt = loaded.tokenizer.encode(TEXT, add_special_tokens=False)[:20]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        free = loaded.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                        pad_token_id=0, eos_token_id=[])[0, 20:].tolist()
    stop = free[3]
    gen_cfg = json.loads((path / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [2, stop]  # as if <|eot_id|> were this token
    (path / "generation_config.json").write_text(json.dumps(gen_cfg))
    loaded = load_model(str(path), tmp_path / "cache")
    assert stop in loaded.eos_token_ids

    async def run():
        async with Engine(tiny_config(), loaded=loaded) as engine:
            return (await run_all(engine, [prompt], [SamplingParams(max_tokens=8, temperature=0.0)]))[0]

    result = asyncio.run(run())
    assert result.finish_reason == "stop"
    assert result.token_ids == free[: free.index(stop) + 1]


REFUSED = {
    "phi3-longrope": (Phi3Config(**{**COMMON, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}), "rope_type.*'longrope'"),
    "llama-dynamic-rope": (LlamaConfig(**{**COMMON, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}), "rope_type.*'dynamic'"),
    "gemma3-bidirectional": (Gemma3TextConfig(**{**COMMON, "use_bidirectional_attention": True}),
                             "use_bidirectional_attention"),
    # transformers' Gemma 3 attention never applies it (Gemma 2's does): the engine capped (session 21 audit)
    "gemma3-attention-softcap": (Gemma3TextConfig(**{**COMMON, "attn_logit_softcapping": 3.0}),
                                 "attn_logit_softcapping 3.0 on Gemma 3"),
    "qwen2-unknown-layer-type": (Qwen2Config(**{**COMMON, "layer_types": ["full_attention", "chunked_attention"]}),
                                 "layer_types"),
    "llama-gelu": (LlamaConfig(**{**COMMON, "hidden_act": "relu"}), "hidden_act 'relu'"),
    "gpt2": (GPT2Config(), "supported: LlamaForCausalLM, MistralForCausalLM"),
    # transformers' generate slides its cache by these; the engine's Llama attends to all (session 19 audit)
    "llama-sliding-window": (LlamaConfig(**{**COMMON, "sliding_window": 12}), "sliding_window 12 on LlamaForCausalLM"),
    "llama-chunked-attention": (LlamaConfig(**{**COMMON, "attention_chunk_size": 12}), "attention_chunk_size 12"),
    "phi3-chunked-attention": (Phi3Config(**{**COMMON, "sliding_window": None, "attention_chunk_size": 12}),
                               "attention_chunk_size 12"),
}


@pytest.mark.parametrize("config,message", REFUSED.values(), ids=REFUSED.keys())
def test_unimplemented_features_are_refused(tmp_path, config, message):
    config.architectures = [{"phi3": "Phi3ForCausalLM", "llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}[config.model_type.split("_")[0]]]
    config.save_pretrained(tmp_path)  # config.json only: refused before any weight is looked for
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), tmp_path / "cache")


@pytest.mark.parametrize("extra,message", [
    # transformers' masks turn bidirectional under it, for every family: logits differed by ~1.5 (session 25 audit)
    ({"is_causal": False}, "is_causal=False"),
    # transformers raises its own RuntimeError on any global attribute: it escaped as a traceback
    ({"per_layer_config": {"1": {"rms_norm_eps": 0.5}}}, "per_layer_config"),
], ids=["is-causal-false", "per-layer-config"])
def test_config_keys_that_change_every_family_are_refused(tmp_path, extra, message):
    LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), tmp_path / "cache")


def test_a_multimodal_gemma3_config_under_the_causal_lm_is_refused(tmp_path):
    """Gemma3ForCausalLM named over a config nested under text_config ended in AttributeError
    'Gemma3Config' object has no attribute 'hidden_size'."""
    from transformers import Gemma3Config

    config = Gemma3Config(text_config=Gemma3TextConfig(**COMMON).to_dict())
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="text_config"):
        load_model(str(tmp_path), tmp_path / "cache")
