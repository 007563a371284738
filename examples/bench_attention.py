"""Attention backends on CPU: torch (gather into a workspace + SDPA) vs cpu (C++ kernel that
reads the paged cache in place).

    .venv/bin/python examples/bench_attention.py [--threads N] [--repeats N]

Two steps on SmolLM2-135M's shapes (30 layers, H=9, KVH=3, D=64, block size 16):
- decode: B=64 sequences, one new token each, contexts uniform in 100..1000 (seeded);
- prefill: one 256-token chunk of a sequence with 1,000 tokens already cached.
Blocks come from a shuffled pool, as from a fragmented block manager.
For each: attention alone (backend.forward over all 30 layers' caches, per layer; the step's
`prepare` is timed apart) and a whole LlamaModel forward step (prepare, 30 layers, logits).
The cache holds random values (timing does not depend on them); an untimed first call checks
that both backends agree. Best of a few runs, the backends taking turns (the machine may be
shared: check `uptime`, compare ratios).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention.cpu_backend import CpuAttention  # noqa: E402
from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttention  # noqa: E402
from engine.batch import Seq, flatten_batch  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.loader import load_model  # noqa: E402

BLOCK = 16


def timed(fns: dict[str, callable], repeats: int) -> dict[str, float]:
    """Best-of-`repeats` seconds per function, after one warm-up call each. The functions take
    turns, so a burst of load from other users hits both sides alike; the minimum is the
    least disturbed run."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def make_step(query_lens: list[int], context_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Metadata for one step, each sequence's blocks drawn from a shuffled pool (as from a
    fragmented block pool); returns it, the positions [T] and the number of blocks."""
    counts = [-(-(ctx + q_len) // BLOCK) for q_len, ctx in zip(query_lens, context_lens)]
    pool = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(2)).tolist()
    seqs = []
    for q_len, ctx, n in zip(query_lens, context_lens, counts):
        table, pool = pool[:n], pool[n:]
        seqs.append(Seq([0] * q_len, ctx, table))
    batch = flatten_batch(seqs, BLOCK)
    return batch.meta, batch.positions, sum(counts)


@torch.inference_mode()
def bench_case(model: LlamaModel, backends, query_lens, context_lens, repeats: int) -> list[tuple[str, float, float]]:
    s = model.shape
    meta, positions, num_blocks = make_step(query_lens, context_lens)
    t = meta.num_tokens
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(s.num_layers, num_blocks, BLOCK, s.num_kv_heads, s.head_dim)
    cache.data.normal_(generator=gen)
    q = torch.randn(t, s.num_heads, s.head_dim, generator=gen)  # [T, H, D]
    k = torch.randn(t, s.num_kv_heads, s.head_dim, generator=gen)  # [T, KVH, D]
    v = torch.randn(t, s.num_kv_heads, s.head_dim, generator=gen)
    ids = torch.randint(0, s.vocab_size, (t,), generator=gen)
    rows = meta.query_start_loc[1:] - 1  # last token of each sequence
    plans, outputs = {}, {}
    for be in backends:
        model.backend = be
        plans[be.name] = be.prepare(meta)
        outputs[be.name] = (
            be.forward(q, k, v, *cache.layer(0), meta, plans[be.name]),
            model.forward(ids, positions, meta, cache, rows),
        )
    (a_t, l_t), (a_c, l_c) = outputs["torch"], outputs["cpu"]
    assert torch.allclose(a_t, a_c, atol=1e-4, rtol=1e-4), f"attention differs: {(a_t - a_c).abs().max()}"
    assert torch.allclose(l_t, l_c, atol=1e-2, rtol=1e-3), f"logits differ: {(l_t - l_c).abs().max()}"

    def attention(be):  # every layer's cache once, as in a step: per-layer data is not in cache
        for i in range(s.num_layers):
            be.forward(q, k, v, *cache.layer(i), meta, plans[be.name])

    def step(be):
        model.backend = be
        model.forward(ids, positions, meta, cache, rows)

    prep = timed({be.name: lambda be=be: be.prepare(meta) for be in backends}, repeats)
    attn = timed({be.name: lambda be=be: attention(be) for be in backends}, repeats)
    full = timed({be.name: lambda be=be: step(be) for be in backends}, repeats)
    return [
        ("prepare", prep["torch"], prep["cpu"]),
        ("attention / layer", attn["torch"] / s.num_layers, attn["cpu"] / s.num_layers),
        ("model step", full["torch"], full["cpu"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (best)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the decode contexts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    cpu = CpuAttention()  # builds the kernel on first use
    print(f"kernel ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    config = EngineConfig.load(Path(__file__).resolve().parent.parent / "config.toml")
    loaded = load_model("smollm2-135m", config.model.resolved_cache_dir())
    model = LlamaModel(loaded.hf_model, TorchAttention())
    backends = (TorchAttention(), cpu)
    print(f"{loaded.name}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}\n")

    ctx = torch.randint(100, 1001, (64,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    cases = [
        (f"decode B=64, ctx 100-1000 (mean {sum(ctx) / 64:.0f})", [1] * 64, ctx),
        ("prefill 256 after 1000 cached", [256], [1000]),
    ]
    print("| case | measure | torch ms | cpu ms | torch/cpu |")
    print("|---|---|---:|---:|---:|")
    for name, q_lens, c_lens in cases:
        for measure, tm, cp in bench_case(model, backends, q_lens, c_lens, args.repeats):
            print(f"| {name} | {measure} | {tm * 1e3:.2f} | {cp * 1e3:.2f} | {tm / cp:.2f}x |", flush=True)
    print(f"\nload {os.getloadavg()[0]:.1f}, total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
