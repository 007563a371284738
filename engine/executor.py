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

import torch

from engine.batch import flatten_batch
from engine.kv_cache import KVCache
from engine.messages import Execute, ExecutorMsg, Shutdown, StepPlan, StepResult
from engine.model.llama import LlamaModel
from engine.sampler import sample


class Executor:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, fault_hook: Callable[[StepPlan], None] | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        # Test hook: called in the worker thread before each step; may raise to fail it.
        self.fault_hook = fault_hook
        self.inbox: asyncio.Queue[ExecutorMsg] = asyncio.Queue()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepwise-step")

    async def execute(self, plan: StepPlan) -> StepResult:
        reply = asyncio.get_running_loop().create_future()
        self.inbox.put_nowait(Execute(plan, reply))
        return await reply

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                match await self.inbox.get():
                    case Execute(plan, reply):
                        result = await loop.run_in_executor(self._thread, self._run_step, plan)
                        if not reply.done():
                            reply.set_result(result)
                    case Shutdown():
                        return
        finally:
            self._thread.shutdown(wait=True)

    def _run_step(self, plan: StepPlan) -> StepResult:
        start_wall, start = time.time(), time.perf_counter()
        try:
            if self.fault_hook is not None:
                self.fault_hook(plan)
            sampled, forward_s = self.run_plan(plan)
            error = None
        except Exception as e:  # one bad step fails its requests, not the engine
            sampled, forward_s, error = {}, 0.0, f"{type(e).__name__}: {e}"
        return StepResult(
            step=plan.step, sampled=sampled, start_time=start_wall, duration_s=time.perf_counter() - start,
            forward_s=forward_s, error=error,
        )

    def run_plan(self, plan: StepPlan) -> tuple[dict[str, int], float]:
        """The sampled token per request, and the seconds the model forward took."""
        device = self.model.device
        self.kv_cache.copy_blocks(plan.block_copies)  # before the forward writes into the copies
        batch = flatten_batch(plan.items, self.block_size, device)
        sampling = [i for i, item in enumerate(plan.items) if item.sample]
        rows = torch.tensor([batch.logits_rows[i] for i in sampling], dtype=torch.long, device=device)
        forward_start = time.perf_counter()
        logits = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_cache, rows)  # [S, V]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # so forward_s is the forward, not its launch
        forward_s = time.perf_counter() - forward_start
        if not sampling:
            return {}, forward_s
        chosen = [plan.items[i] for i in sampling]
        # one draw per item, and one more per fork (n > 1) from the same row with its own generator
        draws = [(c, rid, gen) for c in chosen for rid, gen in [(c.request_id, c.generator), *c.forks]]
        logits = logits.cpu()
        if len(draws) > len(chosen):
            logits = logits[[k for k, c in enumerate(chosen) for _ in range(1 + len(c.forks))]]  # [S + forks, V]
        tokens = sample(
            logits,
            [c.temperature for c, _, _ in draws],
            [c.top_k for c, _, _ in draws],
            [c.top_p for c, _, _ in draws],
            [gen for _, _, gen in draws],
        )
        return {rid: t for (_, rid, _), t in zip(draws, tokens)}, forward_s
