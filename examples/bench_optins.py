"""Speed and greedy parity of each numeric option against transformers' fp32 model (CPU).

    .venv/bin/python examples/bench_optins.py [--threads N]

Variants: fp32 with plain F.linear (the engine before oneDNN), fp32 with oneDNN prepacked
linears (the default), bfloat16 weights and activations, and int8 dynamic quantization of
every projection (the opt-ins). For each: prefill tokens/s at 512 tokens and decode tokens/s
at 64 sequences (ctx 128), each next to transformers' fp32 forward measured alongside (as in
examples/bench_forward.py); and greedy parity: 32 greedy tokens on six prompts (English and
Chinese, chat-templated and raw) against transformers' fp32 `generate(do_sample=False)` —
how many prompts match exactly, and the mean number of tokens before the first divergence.
Not a test: speeds vary with the machine and whatever else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_forward import Paged, bench_decode, bench_prefill, positive_int  # noqa: E402

from engine.attention.backend import get_backend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.loader import load_model  # noqa: E402

GREEDY = 32
PROMPTS = [
    ("chat", "Give me three tips for writing clear documentation."),
    ("chat", "What is the capital of Australia, and why was it chosen?"),
    ("chat", "请用两句话解释什么是机器学习。"),
    ("raw", "Once upon a time, in a village at the edge of a forest,"),
    ("raw", "import numpy as np\n\ndef softmax(x):\n"),
    ("raw", "长城是中国古代的军事防御工程，"),
]
VARIANTS = [  # name, dtype, linear backend
    ("fp32, F.linear (before)", torch.float32, "torch"),
    ("fp32, oneDNN prepacked (default)", torch.float32, "onednn"),
    ("bf16 (opt-in dtype)", torch.bfloat16, "torch"),
    ("fp32 + int8 dynamic quant (opt-in)", torch.float32, "int8"),
]


def encode(tokenizer, kind: str, text: str) -> list[int]:
    if kind == "chat":
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(text)["input_ids"]


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    x = torch.tensor([prompt])
    out = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=GREEDY, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def our_greedy(model: LlamaModel, prompt: list[int]) -> list[int]:
    paged = Paged(model, num_blocks=(len(prompt) + GREEDY) // 16 + 2)
    logits = paged.step([(0, prompt)])
    out = []
    for _ in range(GREEDY):
        out.append(int(logits[0].argmax()))
        logits = paged.step([(0, out[-1:])])
    return out


def agreement(ours: list[int], ref: list[int]) -> int:
    """Tokens before the first divergence (`ref` may be shorter: generate stops at EOS)."""
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                        help="comma-separated indexes into the variant list, in run order")
    args = parser.parse_args()
    indexes = [str(i) for i in range(len(VARIANTS))]
    if any(i not in indexes for i in args.variants.split(",")):
        parser.error(f"--variants: comma-separated indexes in {', '.join(indexes)}, got {args.variants!r}")
    torch.set_num_threads(args.threads)
    config = EngineConfig.load(Path(__file__).resolve().parent.parent / "config.toml")
    cache_dir = config.model.resolved_cache_dir()
    reference = load_model("smollm2-135m", cache_dir)  # transformers, fp32
    prompts = [encode(reference.tokenizer, kind, text) for kind, text in PROMPTS]
    expected = [hf_greedy(reference.hf_model, p) for p in prompts]
    backend = get_backend(config.model.attention_backend, torch.device("cpu"))

    print(f"{backend.name} attention, {torch.get_num_threads()} threads; greedy: {GREEDY} tokens x {len(prompts)} prompts\n")
    print("| variant | prefill 512 tok/s (x HF fp32) | decode B=64 tok/s (x HF fp32) | prompts identical | mean tokens before divergence |")
    print("|---|---:|---:|---:|---:|")
    for name, dtype, linear in (VARIANTS[int(i)] for i in args.variants.split(",")):
        source = reference if dtype == torch.float32 else load_model("smollm2-135m", cache_dir, dtype)
        model = LlamaModel(source.hf_model, backend, "cpu", linear)
        same = [agreement(our_greedy(model, p), e) for p, e in zip(prompts, expected)]
        identical = sum(n == len(e) for n, e in zip(same, expected))
        exact = dtype == torch.float32 and linear != "int8"
        pre_o, pre_h = bench_prefill(reference, model, 512, 3)
        dec_o, dec_h = bench_decode(reference, model, 64, 2, 5, tol=1e-2 if exact else float("inf"))
        print(f"| {name} | {pre_o:,.0f} ({pre_o / pre_h:.2f}x) | {dec_o:,.0f} ({dec_o / dec_h:.2f}x) | "
              f"{identical}/{len(same)} | {statistics.mean(same):.1f} |", flush=True)


if __name__ == "__main__":
    main()
