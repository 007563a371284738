"""Traces: the requests a simulation replays, one JSON object a line.

    {"arrival_s": 0.12, "prompt_tokens": 812, "output_tokens": 64, "prefix_group": "sys-3", "prefix_tokens": 1000, "priority": 0}

`arrival_s` is the offset from the start of the run; `prefix_group`, `prefix_tokens` and
`priority` are optional. Requests of one prefix group share their first `prefix_tokens`
prompt tokens (so the prefix cache and the prefix-affinity router see them as shared). Three
more optional keys let a trace carry what engine-bench's workloads mean: `tag` (reported as
the bench reports it: "steady" streams, "long" prompts), and `after_tokens` / `after_gate_s`
(send only once the run has received that many output tokens, then that many seconds more:
the spike workloads' gates). Any other key is refused.

Traces come from a file (`engine-bench --save-trace` writes the trace of a run it made) or
from the bench's own workload generators (same seed, same requests as `engine-bench`), with
the bench's Poisson arrivals or gamma-distributed gaps of a chosen burstiness.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import msgspec

from engine.bench import workload
from engine.bench.workload import BenchRequest

ARRIVALS = ("poisson", "gamma")
# arrival_s is an offset from the start of the run, and a run's figures (duration, throughput)
# count from that start. A trace whose first request comes a day or more in is a clock time
# (a log's Unix timestamps), which would spread its traffic over decades of idle run: refused.
MAX_FIRST_ARRIVAL_S = 86_400.0


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | int | None = None
    prefix_tokens: int = 0
    priority: int = 0
    tag: str = ""
    after_tokens: int = 0
    after_gate_s: float = 0.0

    def check(self) -> None:
        if not self.arrival_s >= 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"prefix_tokens must be in [0, prompt_tokens], got {self.prefix_tokens}")
        if self.prefix_tokens and self.prefix_group is None:
            raise ValueError("prefix_tokens without a prefix_group")
        if self.after_tokens < 0 or self.after_gate_s < 0:
            raise ValueError("after_tokens and after_gate_s must be >= 0")


_decoder = msgspec.json.Decoder(TraceRequest)
_encoder = msgspec.json.Encoder()


def load(path: str | Path) -> list[TraceRequest]:
    out = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req = _decoder.decode(line)  # malformed JSON and schema errors alike (DecodeError)
                req.check()
            except ValueError as e:
                raise ValueError(f"{path}: trace line {i}: {e}") from None
            out.append(req)
    if not out:
        raise ValueError(f"{path}: the trace is empty")
    first = min(r.arrival_s for r in out)
    if first >= MAX_FIRST_ARRIVAL_S:
        raise ValueError(f"{path}: arrival_s is the offset in seconds from the start of the run, but the first "
                         f"request's is {first:.6g} s, a clock time (a Unix timestamp?): subtract the first "
                         "arrival_s from every line")
    return out


def save(requests: list[TraceRequest], path: str | Path) -> None:
    with open(path, "wb") as f:
        for r in requests:
            f.write(_encoder.encode(r) + b"\n")


def from_bench(requests: list[BenchRequest], arrivals: list[float] | None = None) -> list[TraceRequest]:
    """The bench's requests as token counts. `arrivals`: when each was actually sent (a run's
    trace: gates already resolved, so none is kept); else the workload's own offsets and gates.
    Requests of a "prefix-*" tag (shared-prefix) share the longest prefix common to their tag."""
    groups: dict[str, list[int]] = {}
    for r in requests:
        if r.tag.startswith("prefix-"):
            common = groups.setdefault(r.tag, r.prompt_token_ids)
            groups[r.tag] = common[:_common_len(common, r.prompt_token_ids)]
    out = []
    for i, r in enumerate(requests):
        group = r.tag if r.tag in groups else None
        sent = arrivals is not None
        out.append(TraceRequest(
            arrival_s=arrivals[i] if sent else r.arrival_s, prompt_tokens=len(r.prompt_token_ids),
            output_tokens=r.max_tokens, prefix_group=group, prefix_tokens=len(groups[group]) if group else 0,
            tag=r.tag, after_tokens=0 if sent else r.after_tokens, after_gate_s=0.0 if sent else r.after_gate_s,
        ))
    return out


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def generate(name: str, seed: int = 0, num_requests: int | None = None, rate: float = 0.0,
             arrival: str = "poisson", cv: float = 1.0, vocab_size: int = workload.VOCAB_SIZE) -> list[TraceRequest]:
    """A bench workload as a trace. Poisson arrivals at `rate` are the bench's own (the same
    requests `engine-bench --rate` sends); gamma arrivals have gaps of mean 1/rate and
    coefficient of variation `cv` (cv 1 is Poisson; above 1 burstier), drawn from `seed`."""
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrival!r}; choose from {ARRIVALS}")
    if rate < 0 or cv <= 0:
        raise ValueError(f"rate must be >= 0 and cv > 0, got rate {rate}, cv {cv}")
    if rate > 0 and name in ("spike", "spike-overlap"):
        raise ValueError(f"workload {name!r} sets its own arrivals: --rate does not apply")
    if arrival == "poisson":
        return from_bench(workload.make(name, seed, num_requests, rate, vocab_size))
    trace = from_bench(workload.make(name, seed, num_requests, 0.0, vocab_size))
    if rate == 0:
        return trace
    rng = random.Random(f"gamma-{seed}")
    shape = 1 / cv**2
    t, out = 0.0, []
    for r in trace:
        out.append(msgspec.structs.replace(r, arrival_s=t))
        t += rng.gammavariate(shape, 1 / (rate * shape))
    return out


def scale_rate(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests arriving `factor` times as fast (gaps divided by it)."""
    return [msgspec.structs.replace(r, arrival_s=r.arrival_s / factor) for r in trace]


def token_ids(r: TraceRequest, index: int) -> list[int]:
    """Prompt token ids for a trace request: its group's shared prefix, then ids unique to it
    (the first of them is the request's own, so no two requests share a block beyond their
    prefix). Any int works: the simulator has no vocabulary."""
    prefix = []
    if r.prefix_tokens:
        head = 2**40 + hash_group(r.prefix_group)
        prefix = [head] + [7] * (r.prefix_tokens - 1)
    rest = r.prompt_tokens - r.prefix_tokens
    return prefix + ([1_000_000 + index] + [5] * (rest - 1) if rest else [])


def hash_group(group: str | int | None) -> int:
    """A stable int per prefix group (Python's str hash is salted per process)."""
    return zlib.crc32(msgspec.json.encode(group))
