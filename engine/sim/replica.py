"""One simulated engine: the real Scheduler, policy, BlockManager and KVLedger, wired as
`Engine.start` wires them, with the executor and the request's tokenizer-side parts stood in.

- `SimExecutor`: a step lasts the calibration's forward (times a drawn ratio, with step
  noise) + overhead seconds on the (virtual) loop clock; every sampled request gets a dummy
  token that is never EOS (lengths come from `max_tokens` with `ignore_eos`, as engine-bench
  sends them).
- `NullDetokenizer`: no tokenizer, no text.
- `Delivery`: stands in for a request's OutputBuffer and times each output when the scheduler
  emits it, as engine-bench's reader timestamps each output it takes.
- `submit` refuses what intake refuses (a full queue, a request longer than the model's
  context or the whole KV pool); a refused request fails, as it would in a real run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.admission import check_fits, check_room
from engine.block_manager import BlockManager, BlockManagerClient, Stop
from engine.bench.stats import RequestTiming
from engine.config import EngineConfig
from engine.errors import QueueFullError, RequestError
from engine.kv_ledger import KVLedger
from engine.messages import RequestOutput, Shutdown, StepOutcome, StepPlan, StepRecord, StepResult
from engine.policies import make_policy
from engine.request import Request
from engine.scheduler import Scheduler, plan_shape
from engine.sim.calibration import Calibration
from engine.sim.noise import StepNoise
from engine.step_cost import StepCostModel, StepShape
from engine.step_cost_calibration import calibrate

SAMPLED_TOKEN = 1  # every simulated step samples this id; no request has an EOS id
NO_CONTEXT_LIMIT = 1 << 30  # a calibration that does not know the model's context


class SimExecutor:
    def __init__(self, calibration: Calibration, block_size: int, noise: StepNoise | None = None):
        self.calibration = calibration
        self.block_size = block_size  # step_cost_calibration sizes its plans by it
        self.noise = noise  # None: a step's forward lasts exactly its prediction

    def forward_s(self, shape: StepShape) -> float:
        forward = self.calibration.forward_s(shape)
        return forward * self.noise(forward) if self.noise is not None else forward

    def run_plan(self, plan: StepPlan) -> StepOutcome:
        """What Executor.run_plan returns: the sampled tokens and the forward seconds."""
        forward = self.forward_s(plan_shape(plan))
        return StepOutcome({it.request_id: SAMPLED_TOKEN for it in plan.items if it.sample}, forward)

    async def execute(self, plan: StepPlan) -> StepResult:
        shape = plan_shape(plan)
        forward = self.forward_s(shape)
        cycle = forward + self.calibration.overhead_s(shape)
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(cycle)
        sampled = {it.request_id: SAMPLED_TOKEN for it in plan.items if it.sample}
        return StepResult(step=plan.step, sampled=sampled, start_time=start, duration_s=cycle, forward_s=forward)


class NullDetokenizer:
    hit_stop = False

    def push(self, token_id: int) -> None:
        pass

    def take(self, final: bool = False) -> str:
        return ""


class Delivery:
    """A request's output sink: one timestamp per output with tokens (engine-bench's `_mark`),
    the end time and outcome on the final one, then `on_final()`."""

    def __init__(self, timing: RequestTiming, clock: Callable[[], float], on_tokens: Callable[[int], None],
                 on_final: Callable[[], None]):
        self.timing, self.clock, self.on_tokens, self.on_final = timing, clock, on_tokens, on_final

    def put_nowait(self, out: RequestOutput) -> None:
        t = self.timing
        n = len(out.token_ids)
        if n:
            now = self.clock()
            if t.first_token is None:
                t.first_token = now
            t.token_times.append(now)
            t.num_output_tokens += n
            self.on_tokens(n)
        if out.finished:
            t.end = self.clock()
            if out.finish_reason in ("error", "abort"):
                t.ok = False
                t.error = f"finish_reason {out.finish_reason}: {out.error}"
            self.on_final()


class SimReplica:
    """Construct inside the simulation's running loop (the scheduler reads its clock)."""

    def __init__(self, config: EngineConfig, calibration: Calibration, publish: Callable[[StepRecord], None],
                 noise: StepNoise | None = None):
        c = config
        loop = asyncio.get_running_loop()
        self.config = config
        self.max_model_len = calibration.max_model_len or NO_CONTEXT_LIMIT
        self.kv_capacity_tokens = c.cache.num_blocks * c.cache.block_size
        self.manager = BlockManager(c.cache.num_blocks, c.cache.block_size, c.cache.enable_prefix_caching)
        self.executor = SimExecutor(calibration, c.cache.block_size, noise)
        self.scheduler = Scheduler(
            make_policy(c.scheduler.policy, c), BlockManagerClient(self.manager),
            KVLedger(c.cache.num_blocks, c.cache.block_size), self.executor.execute, publish, pad_token_id=0,
            priority_aging_s=c.scheduler.priority_aging_s, clock=loop.time,
            cost=StepCostModel(split_rows=calibration.split_rows),  # the regimes the calibration found
        )
        if c.scheduler.calibrate_step_cost:  # as Engine.start does, on the stand-in executor
            calibrate(self.executor, self.scheduler.cost, c.cache.num_blocks, self.max_model_len)
        self.tasks = [loop.create_task(self.manager.run()), loop.create_task(self.scheduler.run())]

    @property
    def load(self) -> int:
        """Requests in this replica: queued or running."""
        return self.scheduler.num_queued + len(self.scheduler.running)

    def refusal(self, req: Request) -> str | None:
        """Why intake would refuse the request, if it would (intake's own rules)."""
        try:
            check_room(self.scheduler.num_queued, self.config.scheduler.max_waiting)
            check_fits(req.num_prompt_tokens, req.params.max_tokens, self.max_model_len, self.kv_capacity_tokens)
        except (QueueFullError, RequestError) as e:
            return str(e)
        return None

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    async def stop(self) -> None:
        self.scheduler.inbox.put_nowait(Shutdown())
        await self.tasks[1]
        self.manager.inbox.put_nowait(Stop())
        await self.tasks[0]

    def check_invariants(self) -> None:
        self.manager.check_invariants()
