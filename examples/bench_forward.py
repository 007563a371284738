"""Forward-pass throughput of our paged Llama vs transformers, on the real model (CPU).

    .venv/bin/python examples/bench_forward.py [--threads N] [--weight-format F] [--rows 1,16] [--skip-hf]

Prefill: one sequence of N tokens in one forward (ours: a fresh paged step; HF: a [1, N]
forward with logits_to_keep=1 and its default DynamicCache).
Decode: B sequences, each with a 128-token context already cached, one new token each per
step (ours: one flattened paged step of B tokens; HF: a [B, 1] forward over a DynamicCache
prefilled to the same context). Contexts are filled once (one 128-token prefill, copied to
every sequence's own blocks / batch row) and are not timed; a first, untimed step checks
that both sides give the same logits.

Native GGUF weights (second table): steps of R decode rows (R sequences, 32-token contexts)
with every projection on the GGUF block kernel (fp32 activations, weight_format "gguf"), each
layer op by op or through the fused layer halves (engine/model/fused_layer.py), on the same
kernel with int8 activations ("gguf-q8"), on the dense fp32 copy (oneDNN), and as the
chosen weight_format runs them (the kernel up to engine.cpu.kernel_max_rows rows): same model object, the
per-projection row threshold and activation kind set for each run.

Each number is the median of a few timed runs after warm-up. Not a test: numbers vary with
the machine and with whatever else is running on it.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention.backend import get_backend  # noqa: E402
from engine.batch import Seq, flatten_batch  # noqa: E402
from engine.cli_args import numbers, positive_int  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cpu import cpu_info  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.model.fused_layer import FusedLayers  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model import quant_kernel  # noqa: E402
from engine.cpu import kernel_max_rows  # noqa: E402
from engine.model.quant_linear import QuantLinear  # noqa: E402

PREFILL_LENS = (512, 2048)
DECODE_BATCHES = (1, 16, 64)
NATIVE_ROWS = (1, 16, 64, 256, 512)
NATIVE_CONTEXT = 32
CONTEXT = 128
BLOCK = 16
TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; later, stored programs let the same hardware run any algorithm. "
)


class Paged:
    """Minimal block bookkeeping for the benchmark: sequence s owns its own blocks."""

    def __init__(self, model: LlamaModel, num_blocks: int):
        s = model.shape
        self.model = model
        self.cache = KVCache(s.num_layers, num_blocks, BLOCK, s.num_kv_heads, s.head_dim, model.dtype)
        self.reset()

    def reset(self) -> None:
        self.next_block = 0
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def grow(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK < length:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def step(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        seqs = []
        for seq, toks in items:
            ctx = self.lens.get(seq, 0)
            seqs.append(Seq(toks, ctx, list(self.grow(seq, ctx + len(toks)))))
            self.lens[seq] = ctx + len(toks)
        b = flatten_batch(seqs, BLOCK)
        return self.model.forward(b.input_ids, b.positions, b.meta, self.cache, torch.tensor(b.logits_rows))

    def clone_context(self, src: int, dst: int) -> None:
        """Give `dst` its own blocks holding a copy of `src`'s cached context."""
        n = self.lens[src]
        table = self.grow(dst, n)
        src_blocks = torch.tensor(self.tables[src][: len(table)])
        self.cache.data[:, :, torch.tensor(table)] = self.cache.data[:, :, src_blocks]
        self.lens[dst] = n


CLOCK = time.perf_counter  # --clock cpu: time.process_time (see main)


def timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(TEXT)["input_ids"]
    return ids[:n]


@torch.inference_mode()
def bench_prefill(loaded, ours: LlamaModel, n: int, repeats: int) -> tuple[float, float]:
    ids = prompt_ids(loaded.tokenizer, n)
    paged = Paged(ours, num_blocks=n // BLOCK + 1)

    def ours_once():
        paged.reset()
        paged.step([(0, ids)])

    x = torch.tensor([ids])

    def hf_once():
        loaded.hf_model(x, logits_to_keep=1, use_cache=True)

    return n / timed(ours_once, 1, repeats), n / timed(hf_once, 1, repeats)


@torch.inference_mode()
def bench_decode(loaded, ours: LlamaModel, batch: int, warmup: int, steps: int, tol: float = 1e-2) -> tuple[float, float]:
    ctx = prompt_ids(loaded.tokenizer, CONTEXT)
    blocks_per_seq = (CONTEXT + 1 + warmup + steps) // BLOCK + 1
    paged = Paged(ours, num_blocks=batch * blocks_per_seq + 1)
    paged.step([(0, ctx)])
    for s in range(1, batch):
        paged.clone_context(0, s)
    next_tok = [ctx[-1]]

    def ours_step():
        return paged.step([(s, next_tok) for s in range(batch)])

    # transformers 5 renamed the forward argument `past_key_values` to `cache`.
    cache_arg = "cache" if "cache" in inspect.signature(loaded.hf_model.forward).parameters else "past_key_values"
    out = loaded.hf_model(torch.tensor([ctx]), use_cache=True)
    cache = copy.deepcopy(getattr(out, "cache", None) or out.past_key_values)
    cache.batch_repeat_interleave(batch)
    x = torch.full((batch, 1), ctx[-1])

    def hf_step():
        return loaded.hf_model(x, use_cache=True, **{cache_arg: cache}).logits[:, -1]

    # Sanity: both sides really decode over the 128-token context (first step, same inputs).
    first_ours, first_hf = ours_step(), hf_step()
    diff = (first_ours - first_hf).abs().max().item()
    assert diff < tol and cache.get_seq_length() == CONTEXT + 1, f"decode mismatch: max |diff| {diff}"
    return batch / timed(ours_step, warmup, steps), batch / timed(hf_step, warmup, steps)


def auto_rows(int8_activations: bool = False) -> int:
    """The row count up to which the default runs the kernel, on this CPU's kernel path."""
    return kernel_max_rows(quant_kernel.best_isa(), int8_activations)


def set_kernel_use(model: LlamaModel, max_rows: int, int8_activations: bool, fused: bool = True) -> None:
    """Steps of up to max_rows rows run the block kernel (on int8 or fp32 activations), larger
    ones the dense copy; fp32 kernel steps through the fused layer halves unless `fused` is off."""
    for p in [model.lm_head] + [getattr(w, f) for w in model.layers for f in ("qkv", "o", "gate_up", "down")]:
        if isinstance(p, QuantLinear):
            p.max_rows, p.int8_activations = max_rows, int8_activations
    model.fused = FusedLayers.for_model(model) if fused else None


@torch.inference_mode()
def bench_native(ours: LlamaModel, rows: int, warmup: int, steps: int) -> dict[str, float]:
    """Decode steps of `rows` sequences: tok/s with kernel (fp32 / int8 activations), dense, and
    the model's own weight_format on the same weights."""
    blocks_per_seq = (NATIVE_CONTEXT + 1 + warmup + 5 * steps + 5) // BLOCK + 1
    chosen = ours.weight_format == "gguf-q8"
    runs = (("kernel", 1 << 30, False, True), ("kernel-ops", 1 << 30, False, False), ("kernel-q8", 1 << 30, True, False),
            ("dense", 0, False, False), ("auto", auto_rows(chosen), chosen, True))
    out = {}
    for name, max_rows, int8, fused in runs:
        set_kernel_use(ours, max_rows, int8, fused)
        paged = Paged(ours, num_blocks=rows * blocks_per_seq + 1)
        paged.step([(0, list(range(1000, 1000 + NATIVE_CONTEXT)))])
        for s in range(1, rows):
            paged.clone_context(0, s)
        out[name] = rows / timed(lambda: paged.step([(s, [1234]) for s in range(rows)]), warmup, steps)
        del paged
    set_kernel_use(ours, auto_rows(chosen), chosen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="torch intra-op threads")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed prefill runs per shape (median)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed decode steps per batch size (median)")
    parser.add_argument("--attention", default=None, help="our attention backend (default: config.toml's)")
    parser.add_argument("--linear", default=None, help="our linear backend: auto, onednn, torch (default: config.toml's)")
    parser.add_argument("--weight-format", default=None, help="auto, dequantized, gguf, gguf-q8 (default: config.toml's)")
    parser.add_argument("--rows", type=numbers(int, 1), default=",".join(map(str, NATIVE_ROWS)),
                        help="decode rows per step, native table")
    parser.add_argument("--skip-hf", action="store_true", help="only the native GGUF table")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (with --threads 1, the compute time even on a loaded machine)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)

    config = EngineConfig.load(Path(__file__).resolve().parent.parent / "config.toml")
    t0 = time.perf_counter()
    loaded = load_model("smollm2-135m", config.model.resolved_cache_dir())
    backend = get_backend(args.attention or config.model.attention_backend, torch.device("cpu"))
    ours = LlamaModel(loaded.hf_model, backend, "cpu", args.linear or config.model.linear_backend, loaded.gguf,
                      args.weight_format or config.model.weight_format)
    print(
        f"ours: {backend.name} attention, {ours.linear} linears, {ours.weight_format} weights; "
        f"model {loaded.name} ({sum(p.numel() for p in loaded.hf_model.parameters()) / 1e6:.0f}M params, fp32), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, HF attn "
        f"{loaded.hf_model.config._attn_implementation}; loaded in {time.perf_counter() - t0:.1f}s\n",
        flush=True,
    )

    print(f"cpu: {cpu_info().describe()}; load 1m {os.getloadavg()[0]:.2f}; {args.clock} clock\n", flush=True)

    if ours.weight_format in ("gguf", "gguf-q8"):
        print(f"| decode rows per step (ctx {NATIVE_CONTEXT}) | dense fp32 tok/s | GGUF kernel, op by op tok/s | "
              f"GGUF kernel, fused layers tok/s | fused/dense | fused/op by op | kernel, int8 activations tok/s | "
              f"{ours.weight_format} (kernel <= {auto_rows(ours.weight_format == 'gguf-q8')} rows) tok/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in args.rows:
            t = bench_native(ours, r, warmup=2, steps=args.steps)
            print(f"| {r} | {t['dense']:,.0f} | {t['kernel-ops']:,.0f} | {t['kernel']:,.0f} | "
                  f"{t['kernel'] / t['dense']:.2f}x | {t['kernel'] / t['kernel-ops']:.2f}x | {t['kernel-q8']:,.0f} | "
                  f"{t['auto']:,.0f} |", flush=True)
        print()
    if args.skip_hf:
        print(f"total {time.perf_counter() - t0:.0f}s")
        return

    rows = []
    for n in PREFILL_LENS:
        o, h = bench_prefill(loaded, ours, n, args.repeats)
        rows.append((f"prefill {n} tokens", o, h))
        print(f"  done: prefill {n}", file=sys.stderr, flush=True)
    for b in DECODE_BATCHES:
        o, h = bench_decode(loaded, ours, b, warmup=2, steps=args.steps)
        rows.append((f"decode B={b} (ctx {CONTEXT})", o, h))
        print(f"  done: decode B={b}", file=sys.stderr, flush=True)

    print("| shape | ours tok/s | HF tok/s | ours/HF |")
    print("|---|---:|---:|---:|")
    for name, o, h in rows:
        print(f"| {name} | {o:,.0f} | {h:,.0f} | {o / h:.2f}x |")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
