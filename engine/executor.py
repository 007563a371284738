"""The step executor actor: owns the model and the KV cache memory.

It turns a StepPlan into the flattened batch (token ids, positions, slot mapping, block
tables), makes the plan's block copies (copy-on-write for n > 1), runs the forward and the
sampler in its own worker thread — the event loop keeps
serving HTTP and the monitor during a long step — and answers with the sampled tokens. A
step that raises is reported as a failed StepResult; the actor itself carries on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from engine.batch import flatten_batch
from engine.kv_cache import KVCache
from engine.logits_processors import needs_processing, process_logits
from engine.logprobs import token_logprobs
from engine.messages import Execute, ExecutorMsg, PlanItem, Shutdown, StepOutcome, StepPlan, StepResult, TokenLogprob
from engine.model.llama import LlamaModel
from engine.sampler import sample
from engine.structured.mask import advance, constrain
from engine.torch_thread import torch_thread


class Executor:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, fault_hook: Callable[[StepPlan], None] | None = None,
                 thread: ThreadPoolExecutor | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        # Test hook: called in the worker thread before each step; may raise to fail it.
        self.fault_hook = fault_hook
        self.inbox: asyncio.Queue[ExecutorMsg] = asyncio.Queue()
        # the one thread that runs torch for this engine (engine/torch_thread.py); shut down with the actor
        self._thread = thread or torch_thread()

    async def execute(self, plan: StepPlan) -> StepResult:
        reply = asyncio.get_running_loop().create_future()
        self.inbox.put_nowait(Execute(plan, reply))
        return await reply

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        wait = True  # after a Shutdown the thread is idle: joining it returns at once
        try:
            while True:
                match await self.inbox.get():
                    case Execute(plan, reply):
                        result = await loop.run_in_executor(self._thread, self._run_step, plan)
                        if not reply.done():
                            reply.set_result(result)
                    case Shutdown():
                        return
        except asyncio.CancelledError:
            wait = False  # maybe mid-step (a stop that timed out): the loop must not wait for the step
            raise
        finally:
            self._thread.shutdown(wait=wait)

    def _run_step(self, plan: StepPlan) -> StepResult:
        start_wall, start = time.time(), time.perf_counter()
        try:
            if self.fault_hook is not None:
                self.fault_hook(plan)
            out = self.run_plan(plan)
            error = None
        except Exception as e:  # one bad step fails its requests, not the engine
            out, error = StepOutcome({}, 0.0), f"{type(e).__name__}: {e}"
        return StepResult(
            step=plan.step, sampled=out.sampled, start_time=start_wall, duration_s=time.perf_counter() - start,
            forward_s=out.forward_s, error=error, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
            failed=out.failed,
        )

    @torch.inference_mode()  # the logits are inference tensors: processing updates them in place
    def run_plan(self, plan: StepPlan) -> StepOutcome:
        """The sampled token per request (and logprobs where asked), and the seconds the model forward took."""
        device = self.model.device
        self.kv_cache.copy_blocks(plan.block_copies)  # before the forward writes into the copies
        batch = flatten_batch(plan.items, self.block_size, device)
        sampling = [i for i, item in enumerate(plan.items) if item.sample]
        scored = [i for i, item in enumerate(plan.items) if item.prompt_targets]
        rows = [batch.logits_rows[i] for i in sampling]
        for i in scored:  # prompt logprobs: the rows of the item's first len(targets) tokens
            item = plan.items[i]
            first = batch.logits_rows[i] - (len(item.token_ids) - item.num_padding - 1)
            rows += range(first, first + len(item.prompt_targets))
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        forward_start = time.perf_counter()
        logits = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_cache, rows_t)  # [R, V]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # so forward_s is the forward, not its launch
        forward_s = time.perf_counter() - forward_start
        prompt_logprobs = _prompt_logprobs([plan.items[i] for i in scored], logits[len(sampling):])
        if not sampling:
            return StepOutcome({}, forward_s, prompt_logprobs=prompt_logprobs)
        chosen = [plan.items[i] for i in sampling]
        logits = logits[: len(sampling)].cpu()  # [S, V]
        if any(c.forks for c in chosen):  # n > 1: each fork draws from its choice 0's row
            logits = logits[[k for k, c in enumerate(chosen) for _ in range(1 + len(c.forks))]]  # [S + forks, V]
            chosen = [d for c in chosen for d in (c, *_fork_items(c))]
        want_logprobs = [j for j, c in enumerate(chosen) if c.logprobs >= 0]
        raw = logits[want_logprobs].clone() if want_logprobs else None  # [L, V]: before processing
        grammars = [c.grammar for c in chosen]
        constrain(logits, grammars)  # structured-output rows: only what their grammar allows (first, as vLLM)
        if needs_processing(chosen):
            logits = process_logits(logits, chosen)
        failed = _unsampleable(logits, chosen)  # [S] rows left without a token: their requests fail alone
        tokens = sample(
            logits,
            [c.temperature for c in chosen],
            [c.top_k for c in chosen],
            [c.top_p for c in chosen],
            [c.generator for c in chosen],
        )
        for j in advance(grammars, tokens):
            failed.setdefault(j, f"the structured-output grammar refused sampled token {tokens[j]}")
        logprobs = {}
        if raw is not None:
            entries = token_logprobs(raw, [tokens[j] for j in want_logprobs], [chosen[j].logprobs for j in want_logprobs])
            logprobs = {chosen[j].request_id: e for j, e in zip(want_logprobs, entries)}
        sampled = {c.request_id: t for j, (c, t) in enumerate(zip(chosen, tokens)) if j not in failed}
        return StepOutcome(sampled, forward_s, {r: e for r, e in logprobs.items() if r in sampled}, prompt_logprobs,
                           {chosen[j].request_id: why for j, why in failed.items()})


def _unsampleable(logits: torch.Tensor, chosen: list[PlanItem]) -> dict[int, str]:
    """Rows whose masks left no finite logit, each with why; those rows are zeroed so the batch
    still samples (their tokens are dropped). One such request (structured output whose grammar
    can only end while min_tokens masks EOS) must not fail the others. Only rows with a grammar
    or a bias (min_tokens' -inf masks) can lose every token: plain rows are not looked at."""
    masked = [j for j, c in enumerate(chosen) if c.grammar is not None or c.logit_bias]
    if not masked:
        return {}
    rows = torch.tensor(masked)
    left = torch.isfinite(logits[rows]).any(dim=-1).tolist()  # [M]: does the row keep a token?
    failed = {}
    for j in (j for j, ok in zip(masked, left) if not ok):
        c = chosen[j]
        if c.grammar is not None and c.grammar.is_terminated():
            failed[j] = "no token can be sampled: the structured output is complete before min_tokens was reached"
        elif c.grammar is not None:
            failed[j] = ("no token can be sampled: the structured-output grammar allows only tokens that min_tokens "
                         "masks (EOS and stop_token_ids) or logit_bias removes")
        else:
            failed[j] = "no token can be sampled: every token's logit is -inf or NaN after logit_bias, penalties and min_p"
        logits[j] = 0.0
    return failed


def _fork_items(item: PlanItem) -> list[PlanItem]:
    """The choices forked from `item` (n > 1) as items of their own: the same row and sampling
    parameters, each its own request id, generator and grammar state."""
    return [msgspec.structs.replace(item, request_id=rid, generator=gen, grammar=grammar, forks=[], prompt_targets=[])
            for rid, gen, grammar in item.forks]


def _prompt_logprobs(items: list[PlanItem], logits: torch.Tensor) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """logits: [sum of len(targets), V], the items' scoring rows in order."""
    if not items:
        return {}
    targets = [t for item in items for t in item.prompt_targets]
    ks = [item.prompt_logprobs for item in items for _ in item.prompt_targets]
    entries = token_logprobs(logits, targets, ks)
    out, at = {}, 0
    for item in items:
        n = len(item.prompt_targets)
        out[item.request_id] = (item.start_pos + 1, entries[at : at + n])
        at += n
    return out
