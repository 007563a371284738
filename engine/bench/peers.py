"""Peers: the same requests through transformers' own generation, on the model our engine serves.

- transformers-static: `hf_model.generate` on left-padded batches of `batch_size` requests, taken
  in arrival order from those that have arrived when the previous batch ends. A batch decodes
  until its longest request is done; its results are delivered when `generate` returns.
- transformers-cb: transformers' continuous batching manager (`init_continuous_batching`,
  `add_request` at each request's arrival with its own `max_new_tokens`, streaming outputs read
  with `get_result`). It steps in its own thread; the KV cache holds every request at once.

Both are greedy and ignore EOS the way our engine does: transformers is given no EOS id, so EOS
may be generated but stops nothing and no logit is masked; every request gets exactly
`max_tokens` tokens (fewer fails it) and its ids equal plain greedy `generate`. Token times are
taken in the generating thread once a token is on the host: static, one time per `generate` step
(a streamer's `put`), a request's first `max_tokens` of them; CB, the per-token timestamps the
manager records (`record_timestamps`). Send times follow the runner: a request is sent at its
arrival offset, a gated one (`after_tokens`) once that many output tokens were received in all.
The functions block: call them off the event loop. `loaded.hf_model` is left as it was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from engine.bench.arrivals import Arrivals
from engine.bench.stats import RequestTiming
from engine.bench.workload import BenchRequest
from engine.config import EngineConfig
from engine.model.loader import LoadedModel

PEERS = ("transformers-static", "transformers-cb")
POLL_S = 0.05  # longest a CB run waits for an output before checking arrivals and the manager
STOP_TIMEOUT_S = 30.0  # how long stopping the CB manager may wait for its thread


@dataclass(frozen=True)
class PeerSettings:
    batch_size: int = 16  # static: requests per generate call
    max_batch_tokens: int = 256  # CB: tokens per forward pass (our max_num_batched_tokens)
    max_requests_per_batch: int = 64  # CB: requests per forward pass (our max_num_seqs)
    page_size: int = 256  # CB: tokens per KV block (transformers' default)
    device: str = "cpu"  # where the peer runs the model (moved there for the run, then back)

    def __post_init__(self) -> None:
        for key in ("batch_size", "max_batch_tokens", "max_requests_per_batch", "page_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"peer {key} must be >= 1, got {getattr(self, key)}")

    @classmethod
    def from_engine(cls, config: EngineConfig, batch_size: int = 16) -> PeerSettings:
        """The engine's own budgets and device ("auto" resolved as the engine does)."""
        device = config.model.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(batch_size, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, device=device)


@dataclass
class PeerRun:
    timings: list[RequestTiming]  # in request order
    duration: float  # from the start of the arrival schedule until the last request ended
    token_ids: list[list[int]]  # generated ids, in request order ([] where a request failed)


def parse(spec: str, known: tuple[str, ...] = PEERS) -> list[str]:
    """The peer names of `spec` (comma-separated), each one of `known` (the CLI adds llama.cpp's)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown peer {', '.join(unknown) or spec!r}; choose from {', '.join(known)}")
    return names


def run(name: str, loaded: LoadedModel, requests: list[BenchRequest], settings: PeerSettings,
        on_done: Callable[[], None] = lambda: None) -> PeerRun:
    peer = {"transformers-static": run_static, "transformers-cb": run_cb}[name]
    tok = loaded.tokenizer
    pad = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    with _on_device(loaded.hf_model, settings.device):
        return peer(loaded.hf_model, requests, settings, pad, on_done)


class StepClock(BaseStreamer):
    """A streamer for `generate`: it is handed the prompt once, then each step's new tokens on the
    host (so that step's compute is done); it keeps the time of each step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def _generate(hf_model, prompts: list[list[int]], num_new: int, pad: int) -> tuple[list[list[int]], list[float]]:
    """One greedy `generate` over left-padded prompts, EOS ignored: (new ids per row, step times)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, L], padding on the left
    mask = torch.zeros_like(input_ids)  # [B, L], 1 on real tokens
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    # eos_token_id=[]: no EOS id at all (None would fall back to the model's own)
    config = GenerationConfig(do_sample=False, max_new_tokens=num_new, eos_token_id=[], pad_token_id=pad)
    clock = StepClock()
    out = hf_model.generate(input_ids.to(hf_model.device), attention_mask=mask.to(hf_model.device),
                            generation_config=config, streamer=clock)  # [B, L + num_new]
    return out[:, width:].tolist(), clock.times


def run_static(hf_model, requests: list[BenchRequest], settings: PeerSettings, pad: int,
               on_done: Callable[[], None]) -> PeerRun:
    start = time.perf_counter()
    arrivals = Arrivals(requests, start)
    timings: list[RequestTiming | None] = [None] * len(requests)
    token_ids: list[list[int]] = [[] for _ in requests]
    waiting: list[tuple[int, float]] = []  # (request index, send time), in arrival order
    while arrivals.unsent or waiting:
        waiting += arrivals.due(time.perf_counter())
        if not waiting:  # nothing to run: an ungated request is still to come (else every gate is open)
            time.sleep(max(0.0, arrivals.next_at() - time.perf_counter()))
            continue
        batch, waiting = waiting[:settings.batch_size], waiting[settings.batch_size:]
        for i, sent in batch:
            r = requests[i]
            timings[i] = RequestTiming(tag=r.tag, arrival=sent, num_prompt_tokens=len(r.prompt_token_ids))
        want = [requests[i].max_tokens for i, _ in batch]
        try:
            rows, steps = _generate(hf_model, [requests[i].prompt_token_ids for i, _ in batch], max(want), pad)
            error = None if len(steps) == max(want) else f"generate took {len(steps)} steps, not {max(want)}"
        except Exception as e:
            rows, steps, error = [[] for _ in batch], [], f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        for (i, _), row, n in zip(batch, rows, want):
            t = timings[i]
            token_ids[i], t.token_times, t.num_output_tokens, t.end = row[:n], steps[:n], len(row[:n]), end
            t.first_token = t.token_times[0] if t.token_times else None
            if error or t.num_output_tokens != n:
                t.ok, t.error = False, error or f"got {t.num_output_tokens} of {n} tokens"
            arrivals.finish(i, end)
            on_done()
        arrivals.receive(sum(len(token_ids[i]) for i, _ in batch), end)
    return PeerRun(timings, time.perf_counter() - start, token_ids)


def run_cb(hf_model, requests: list[BenchRequest], settings: PeerSettings, pad: int,
           on_done: Callable[[], None]) -> PeerRun:
    """KV cache: enough `page_size` blocks for every request's prompt and output at once, so the
    manager never has to offload; per step at most `max_batch_tokens` tokens and
    `max_requests_per_batch` requests (longer prompts are prefilled in chunks)."""
    num_blocks = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / settings.page_size) for r in requests)
    cb_config = ContinuousBatchingConfig(
        page_size=settings.page_size, num_blocks=num_blocks + 1, max_batch_tokens=settings.max_batch_tokens,
        max_requests_per_batch=settings.max_requests_per_batch)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad)  # -1: no EOS for the manager
    attn = hf_model.config._attn_implementation  # the manager may switch it; stop() switches it back
    timings: list[RequestTiming | None] = [None] * len(requests)
    token_ids: list[list[int]] = [[] for _ in requests]
    manager, error = None, None
    start = time.perf_counter()
    try:
        manager = hf_model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        manager.warmup()  # CUDA graphs, where used: captured before the clock starts
        manager.start()
        start = time.perf_counter()
        _drive(manager, requests, Arrivals(requests, start), timings, token_ids, on_done)
    except Exception as e:  # reported per request, as a failed engine run is
        error = f"{type(e).__name__}: {e}"
    finally:
        end = time.perf_counter()
        if manager is not None:
            manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=error is not None)
            manager.destroy()
        if hf_model.config._attn_implementation != attn:
            hf_model.set_attn_implementation(attn)
    for i, r in enumerate(requests):  # requests the manager never finished
        if timings[i] is None or timings[i].end is None:
            timings[i] = timings[i] or RequestTiming(tag=r.tag, arrival=end, num_prompt_tokens=len(r.prompt_token_ids))
            timings[i].ok, timings[i].error, timings[i].end = False, error or "not finished", end
            on_done()
    return PeerRun(timings, end - start, token_ids)


def _drive(manager, requests: list[BenchRequest], arrivals: Arrivals, timings: list, token_ids: list,
           on_done: Callable[[], None]) -> None:
    """Send requests as they arrive and read the streamed outputs until every request ended."""
    num_seen = [0] * len(requests)  # tokens streamed so far, per request
    live = 0
    while arrivals.unsent or live:
        for i, _ in arrivals.due(time.perf_counter()):
            r = requests[i]
            sent = time.perf_counter()
            timings[i] = RequestTiming(tag=r.tag, arrival=sent, num_prompt_tokens=len(r.prompt_token_ids))
            if manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.max_tokens,
                                   streaming=True, record_timestamps=True, eos_token_id=-1) is None:
                raise RuntimeError("the continuous batching manager refused a request")
            live += 1
        next_at = arrivals.next_at()
        wait = POLL_S if next_at is None else min(POLL_S, max(0.0, next_at - time.perf_counter()))
        out = manager.get_result(timeout=wait)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before every request ended")
            continue
        i, now = int(out.request_id), time.perf_counter()
        arrivals.receive(len(out.generated_tokens) - num_seen[i], now)
        num_seen[i] = len(out.generated_tokens)
        if out.is_finished():
            _finish(timings[i], out, requests[i].max_tokens, now)
            token_ids[i] = list(out.generated_tokens) if timings[i].ok else []
            live -= 1
            arrivals.finish(i, now)
            on_done()


def _finish(t: RequestTiming, out, max_tokens: int, now: float) -> None:
    t.token_times = list(out.timestamps or [])
    t.first_token = t.token_times[0] if t.token_times else None
    t.num_output_tokens, t.end = len(out.generated_tokens), now
    if out.error is not None:
        t.ok, t.error = False, f"transformers: {out.error}"
    elif t.num_output_tokens != max_tokens or len(t.token_times) != max_tokens:
        t.ok, t.error = False, f"got {t.num_output_tokens} of {max_tokens} tokens ({len(t.token_times)} timestamps)"


@contextmanager
def _on_device(model, device: str) -> Iterator[None]:
    """Run the peer where our engine runs; the model goes back where it was afterwards."""
    home, target = model.device, torch.device(device)
    if target.type == home.type:
        yield
        return
    model.to(target)
    try:
        yield
    finally:
        model.to(home)
