"""What per-request sampling features cost a decode step: 64 running requests, plain vs with
some rows using a feature, timed in one run (the default config's model: SmolLM2-135M).

    .venv/bin/python examples/bench_sampling.py [--running 64] [--reps 20] [--tiny]

Each variant is a plan of `--running` decode items (context 256 tokens, KV blocks of their
own; the KV content is whatever the pool holds, which does not change the cost), run through
the executor's `run_plan` (flatten, forward, logits processing, sampling) exactly as a step
runs. Variants alternate rep by rep so drift hits them alike; the median step time of each
is printed with its ratio to plain. The issue's bound: 8 structured-output rows (xgrammar
bitmask filled, applied and advanced every step, engine/structured/bench.py) and 8 other rows
with penalties in the same step cost <= 10 % more than plain. Add a variant: a function in
VARIANTS that rewrites some items. Not a test: numbers vary with the machine and with whatever
else runs on it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from engine.attention.backend import get_backend
from engine.cli_args import positive_int
from engine.config import EngineConfig
from engine.cpu import cpu_info
from engine.executor import Executor
from engine.kv_cache import KVCache
from engine.messages import Penalties, PlanItem, StepPlan, TokenBias
from engine.model.llama import LlamaModel
from engine.model.loader import load_model
from engine.structured.bench import bench_matchers, rearm

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 256
NUM_FEATURE_ROWS = 8


def decode_items(n: int, block_size: int, vocab: int) -> list[PlanItem]:
    rng = random.Random(0)
    blocks = -(-(CONTEXT + 1) // block_size)
    return [
        PlanItem(request_id=f"r{i}", kind="decode", token_ids=[rng.randrange(vocab)], start_pos=CONTEXT,
                 block_table=list(range(i * blocks, (i + 1) * blocks)), sample=True, temperature=0.8, top_p=0.95,
                 generator=torch.Generator().manual_seed(i))
        for i in range(n)
    ]


def with_penalties(items: list[PlanItem], vocab: int) -> list[PlanItem]:
    """The first rows get presence/frequency/repetition penalties over a 128-token prompt and
    128 generated tokens, min_p and a logit bias."""
    rng = random.Random(1)
    out = list(items)
    for i in range(NUM_FEATURE_ROWS):
        penalties = Penalties(presence=0.5, frequency=0.5, repetition=1.1,
                              output_token_ids=[rng.randrange(vocab) for _ in range(CONTEXT // 2)],
                              prompt_token_ids=[rng.randrange(vocab) for _ in range(CONTEXT // 2)])
        out[i] = msgspec.structs.replace(items[i], penalties=penalties, min_p=0.05,
                                         logit_bias=TokenBias.of([(13, -5.0)]))  # as engine/plan_sampling.py makes it
    return out


def with_grammar(items: list[PlanItem], matchers: list) -> list[PlanItem]:
    """The last rows constrained by a JSON-schema grammar (one matcher each)."""
    out = list(items)
    for i, m in enumerate(matchers):
        out[-1 - i] = msgspec.structs.replace(items[-1 - i], grammar=m)
    return out


VARIANTS: dict[str, Callable[[list[PlanItem], int, list], list[PlanItem]]] = {
    "plain": lambda items, vocab, matchers: items,
    f"{NUM_FEATURE_ROWS} with penalties": lambda items, vocab, matchers: with_penalties(items, vocab),
    f"{NUM_FEATURE_ROWS} structured": lambda items, vocab, matchers: with_grammar(items, matchers[0]),
    f"{NUM_FEATURE_ROWS} structured + {NUM_FEATURE_ROWS} penalties":
        lambda items, vocab, matchers: with_grammar(with_penalties(items, vocab), matchers[1]),
}
BOUND = 1.10  # the issue's: structured + penalties rows cost at most 10 % more than a plain step


def main(running: int, reps: int, tiny: bool) -> None:
    config = EngineConfig.load(ROOT / "config.toml")
    name = "tiny-random" if tiny else config.model.model
    loaded = load_model(name, config.model.resolved_cache_dir(), torch.float32)
    backend = get_backend(config.model.attention_backend, torch.device("cpu"))
    model = LlamaModel(loaded.hf_model, backend, torch.device("cpu"), config.model.linear_backend, loaded.gguf,
                       config.model.weight_format)
    shape = model.shape
    block_size = config.cache.block_size
    num_blocks = running * -(-(CONTEXT + 1) // block_size)
    kv = KVCache(shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim, torch.float32,
                 torch.device("cpu"))
    executor = Executor(model, kv)
    vocab = len(loaded.tokenizer)
    base = decode_items(running, block_size, vocab)
    matchers = [bench_matchers(loaded.tokenizer, shape.vocab_size, loaded.eos_token_ids, NUM_FEATURE_ROWS)
                for _ in range(2)]  # one set per structured variant: each advances its own
    plans = {label: StepPlan(step=0, items=make(base, vocab, matchers), token_budget=running)
             for label, make in VARIANTS.items()}
    times: dict[str, list[float]] = {label: [] for label in plans}
    for plan in plans.values():
        executor.run_plan(plan)  # warm-up
    for _ in range(reps):
        for label, plan in plans.items():
            for group in matchers:
                rearm(group)  # random logits may have closed a grammar: start it over (untimed)
            start = time.perf_counter()
            executor.run_plan(plan)
            times[label].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    cpu = cpu_info()
    print(f"model {name}, {running} decode rows, context {CONTEXT}, {reps} reps, {torch.get_num_threads()} threads, "
          f"cpu {cpu.model} ({', '.join(cpu.features) or 'no avx2'})")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:>40}: median {med * 1e3:7.2f} ms  ratio {med / plain:.3f}")
    both = statistics.median(times[list(VARIANTS)[-1]]) / plain
    print(f"structured + penalties vs plain: {both:.3f} ({'within' if both <= BOUND else 'OVER'} the {BOUND:.2f} bound)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=64,
                        help=f"decode rows, at least {2 * NUM_FEATURE_ROWS} (the last variant's rows are distinct)")
    parser.add_argument("--reps", type=positive_int, default=20)
    parser.add_argument("--tiny", action="store_true", help="the tiny random model instead of the default one")
    args = parser.parse_args()
    if args.running < 2 * NUM_FEATURE_ROWS:
        parser.error(f"--running must be >= {2 * NUM_FEATURE_ROWS}: {NUM_FEATURE_ROWS} structured and "
                     f"{NUM_FEATURE_ROWS} penalised rows, got {args.running}")
    main(args.running, args.reps, args.tiny)
