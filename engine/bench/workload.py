"""Named, seeded workloads. Lengths are in tokens; prompts are ordinary vocabulary tokens.

- mixed: many short prompts and a share of long ones, varied output lengths; all at once
  (rate 0) or Poisson arrivals at `rate` requests/s.
- spike: steady streams decoding, and long prompts arriving one at a time mid-stream: the k-th
  once the streams have received (spike_after + k * spike_every) of their tokens (a token
  count, not a clock time, so each lands mid-stream on any hardware). Separate arrivals on
  streams of 128 tokens: a stall must hit more than 1 % of the streams' gaps to show in their
  P99 (two arrivals x 12 streams = 24 of 1,524 gaps).
- spike-overlap: the hard case for chunked prefill: 12 streams, and two 2,000-token prompts
  both in flight at once — the first once the streams have received a quarter of their tokens,
  the second 0.5 s later. Each long prompt's TTFT shows whether a second prompt slows the first.
- single: one user alone: one request, a 128-token prompt and 256 tokens out (decode speed).
- sharegpt-like: prompt/output lengths drawn from log-normal fits to ShareGPT-style chat
  traffic (median prompt ~200, output ~150 tokens), no dataset download needed.
- shared-prefix: 8 system prompts of 1,000 tokens shared by all requests, each request one of
  them plus a short user turn; for comparing the cluster's routers (`examples/bench_cluster.py`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run
    tag: str = ""  # "long"/"short" in mixed; "long" for the spike's long prompts, "steady" for its streams
    after_tokens: int = 0  # also wait until the run has received this many output tokens in all
    after_gate_s: float = 0.0  # and then this many seconds more


def _prompt(rng: random.Random, n: int, vocab: range) -> list[int]:
    """`n` tokens drawn uniformly from `vocab`: exactly what `n` calls of `rng.choice(vocab)`
    return, leaving `rng` where they leave it, several times faster (an hour of simulated
    traffic draws millions). CPython's choice takes the top k = len(vocab).bit_length() bits of
    one 32-bit Mersenne Twister word per try and tries again while they are >= len(vocab);
    getrandbits(32 * m) is m such words, little-endian. Each round draws one word per token
    still missing (never more than the tries will use) and keeps the accepted ones; the last
    few tokens are drawn one by one."""
    size, out = len(vocab), []
    shift = 32 - size.bit_length()
    while shift >= 0 and n - len(out) >= 64:  # below that, a round costs more than the tries it saves
        need = n - len(out)
        words = rng.getrandbits(32 * need).to_bytes(4 * need, "little")
        tries = np.frombuffer(words, dtype="<u4") >> shift  # [need]
        out += (vocab.start + vocab.step * tries[tries < size].astype(np.int64)).tolist()
    return out + [rng.choice(vocab) for _ in range(n - len(out))]


def mixed(seed: int = 0, num_requests: int = 64, rate: float = 0.0, vocab: range = range(100, 20000)) -> list[BenchRequest]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(num_requests):
        long = i % 4 == 3  # a quarter long, spread through the arrival order
        n = rng.randint(400, 900) if long else rng.randint(16, 160)
        if rate > 0:
            t += rng.expovariate(rate)
        out.append(BenchRequest(_prompt(rng, n, vocab), rng.randint(16, 160), t, "long" if long else "short"))
    return out


def spike(
    seed: int = 0, num_streams: int = 12, num_long: int = 2, long_len: int = 2000, stream_tokens: int = 128,
    spike_after: float = 0.25, spike_every: float = 0.35, spike_at_s: float = 0.0, vocab: range = range(100, 20000),
) -> list[BenchRequest]:
    """Long prompt k is sent once the streams have received `spike_after + k * spike_every`
    of their tokens in all (and not before `spike_at_s`)."""
    rng = random.Random(seed)
    out = [BenchRequest(_prompt(rng, rng.randint(16, 48), vocab), stream_tokens, 0.0, "steady") for _ in range(num_streams)]
    total = num_streams * stream_tokens
    for k in range(num_long):
        gate = int(total * min(1.0, spike_after + k * spike_every))
        out.append(BenchRequest(_prompt(rng, long_len, vocab), 16, spike_at_s, "long", gate))
    return out


def spike_overlap(
    seed: int = 0, num_streams: int = 12, long_len: int = 2000, stream_tokens: int = 128, gap_s: float = 0.5,
    vocab: range = range(100, 20000),
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = [BenchRequest(_prompt(rng, rng.randint(16, 48), vocab), stream_tokens, 0.0, "steady") for _ in range(num_streams)]
    gate = num_streams * stream_tokens // 4
    for k in range(2):
        out.append(BenchRequest(_prompt(rng, long_len, vocab), 16, 0.0, f"long-{k + 1}", gate, k * gap_s))
    return out


def sharegpt_like(seed: int = 0, num_requests: int = 64, rate: float = 0.0, vocab: range = range(100, 20000)) -> list[BenchRequest]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(num_requests):
        n = int(min(1500, max(4, rng.lognormvariate(5.3, 0.9))))
        m = int(min(400, max(4, rng.lognormvariate(5.0, 0.8))))
        if rate > 0:
            t += rng.expovariate(rate)
        out.append(BenchRequest(_prompt(rng, n, vocab), m, t))
    return out


def shared_prefix(
    seed: int = 0, num_requests: int = 256, rate: float = 0.0, vocab: range = range(100, 20000),
    num_prefixes: int = 8, prefix_len: int = 1000, max_tokens: int = 32,
) -> list[BenchRequest]:
    """Chat-like traffic behind a few long system prompts: each request is one of
    `num_prefixes` shared prefixes of `prefix_len` tokens plus a short user turn (16-64
    tokens), chosen at random; tagged with its prefix. What prefix-aware routing is for."""
    rng = random.Random(seed)
    prefixes = [_prompt(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    out, t = [], 0.0
    for _ in range(num_requests):
        k = rng.randrange(num_prefixes)
        if rate > 0:
            t += rng.expovariate(rate)
        out.append(BenchRequest(prefixes[k] + _prompt(rng, rng.randint(16, 64), vocab), max_tokens, t, f"prefix-{k}"))
    return out


def single(seed: int = 0, num_requests: int = 1, rate: float = 0.0, vocab: range = range(100, 20000),
           prompt_len: int = 128, max_tokens: int = 256) -> list[BenchRequest]:
    """`num_requests` (default 1) such requests; with rate > 0 they arrive one after another."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(num_requests):
        if rate > 0 and i:
            t += rng.expovariate(rate)
        out.append(BenchRequest(_prompt(rng, prompt_len, vocab), max_tokens, t))
    return out


VOCAB_SIZE = 20000  # prompt ids are drawn below min(this, the model's vocabulary size)
WORKLOADS = {
    "mixed": mixed, "spike": spike, "spike-overlap": spike_overlap, "sharegpt-like": sharegpt_like,
    "shared-prefix": shared_prefix, "single": single,
}


def make(
    name: str, seed: int = 0, num_requests: int | None = None, rate: float = 0.0, vocab_size: int = VOCAB_SIZE
) -> list[BenchRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    # skip the lowest ids (specials and control bytes in most vocabularies)
    vocab = range(min(100, vocab_size // 2), min(20000, vocab_size))
    if name in ("spike", "spike-overlap"):  # arrivals are set by the spike itself: `rate` does not apply
        return WORKLOADS[name](seed, num_streams=max(1, num_requests - 2) if num_requests else 12, vocab=vocab)
    kwargs = {"seed": seed, "rate": rate, "vocab": vocab}
    if num_requests:
        kwargs["num_requests"] = num_requests
    return WORKLOADS[name](**kwargs)
