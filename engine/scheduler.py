"""The scheduler actor: owns the waiting and running queues and every request's progress.

Its loop is the algorithm: take messages → the policy plans the step (synchronously, against
the local KV ledger) → one message to the block manager settles the step's KV (tables,
prefix hits, refusals) → the executor runs the plan → the output processor applies the
sampled tokens → publish a StepRecord. When the pool is dry the scheduler preempts the
running request with the lowest priority, newest first (recompute: its blocks are freed and
it goes back to the waiting queue).

n > 1: a request's choices are requests of their own (engine/request.py). Choice 0 prefills
the prompt once; the step that samples its first token samples every choice's (one logits
row, each choice's own generator), and the other choices then fork its KV blocks (shared by
reference count; the block manager decides the copy-on-write of a partial last block, the
plan carries the copies). From then on each choice is scheduled, preempted (recomputing only
itself) and finished on its own; an abort of the group's id ends them all.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable

from engine.block_manager import BlockManagerClient, KVGrant
from engine.kv_ledger import KVLedger
from engine.messages import (
    AbortRequest, AddRequest, EngineSnapshot, FinishedRequest, PlanItem, RequestOutput, RequestSnapshot, SchedulerMsg, Shutdown,
    StepItem, StepPlan, StepRecord, StepResult,
)
from engine.output_processor import OutputProcessor, emit
from engine.plan_sampling import sampling_fields
from engine.plan_view import PlanView
from engine.policies import Decision, Idle, Policy
from engine.request import Request, Status
from engine.step_cost import StepCostModel, StepShape, shape_of

MAX_CONSECUTIVE_STEP_FAILURES = 3
KV_BLOCKED_RETRY_S = 0.05  # nothing fits the pool now: wait this long for a free or an abort


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        kv: BlockManagerClient,
        ledger: KVLedger,
        execute: Callable[[StepPlan], "asyncio.Future[StepResult]"],
        publish: Callable[[StepRecord], None],
        pad_token_id: int,
        priority_aging_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        cost: StepCostModel | None = None,
    ):
        self.policy = policy
        self.kv = kv
        self.ledger = ledger
        self.execute = execute
        self.publish = publish
        self.pad_token_id = pad_token_id
        self.priority_aging_s = priority_aging_s
        self.clock = clock  # what "now" is for aging (tests pass a fake one)
        self.outputs = OutputProcessor(clock)
        self.cost = cost or StepCostModel()  # fitted from every step's forward time
        self.view = PlanView(self)
        self.inbox: asyncio.Queue[SchedulerMsg] = asyncio.Queue()
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.num_preemptions = 0
        self.preempted_this_step = False
        self.consecutive_failures = 0
        self.dead: str | None = None
        self._num_adds_pending = 0  # AddRequests in the inbox, not yet applied
        self._cached_this_step = 0  # prefix-cache hits of the step being planned
        self._queried_this_step = 0  # tokens looked up in the prefix cache for it (first lookups)
        self._hit_this_step = 0  # ... and found there
        self._finished: list[FinishedRequest] = []  # left since the last StepRecord

    # --- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not self.requests:
                await self._idle()  # all done: send the last frees, publish what ended, then wait
            # self.requests also holds finished requests a static batch still keeps
            if not await self._receive(block=not self.requests):
                return
            self.preempted_this_step = False
            if self.priority_aging_s > 0:
                self._age_waiting()
            decisions = self.policy.schedule(self.view)
            if not isinstance(decisions, Idle):
                grant = await self.kv.step(self.ledger.take())  # the step's one KV round trip
                decisions = self._settle(decisions, grant)
            if isinstance(decisions, Idle) or not decisions:
                timeout = decisions.timeout_s if isinstance(decisions, Idle) else KV_BLOCKED_RETRY_S
                if timeout is None and self.requests:
                    timeout = KV_BLOCKED_RETRY_S  # blocked on KV: wait for a free or an abort
                await self._idle()
                if not await self._receive(block=True, timeout=timeout):
                    return
                await self._idle()
                continue
            plan = self._make_plan(decisions)  # with its shape and predicted forward time
            result = await self.execute(plan)
            if result.error is None:
                self.cost.observe(plan.shape, result.forward_s, plan.predicted_s)
            stats = self._update(decisions, result)
            self.policy.end_step(self.view)  # e.g. static: a batch whose requests all finished leaves now
            self._publish(plan, result, stats)
            if self.dead:
                # requests that arrived while the fatal step ran fail too, not left unanswered
                if await self._receive(block=False):
                    self._fail_all(self.dead)
                return

    async def _receive(self, block: bool, timeout: float | None = None) -> bool:
        """Apply pending messages (waiting for one if `block`). False = shut down."""
        if block:
            try:
                msg = await asyncio.wait_for(self.inbox.get(), timeout)
            except TimeoutError:
                return True
            if not self._apply(msg):
                return False
        elif self.inbox.empty():
            return True
        while not self.inbox.empty():
            if not self._apply(self.inbox.get_nowait()):
                return False
        return True

    def add(self, request: Request) -> None:
        """Intake hands over an accepted request (applied at the scheduler's next turn)."""
        self._num_adds_pending += 1
        self.inbox.put_nowait(AddRequest(request))

    def abort(self, request_id: str) -> None:
        """End a request (or every choice of a group) at the scheduler's next turn."""
        self.inbox.put_nowait(AbortRequest(request_id))

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet running: what admission control must count, even
        while a step runs and the inbox is not being read."""
        return len(self.waiting) + self._num_adds_pending

    @property
    def num_arriving(self) -> int:
        """Requests handed over and not yet applied (they arrived during the step now running)."""
        return self._num_adds_pending

    def _apply(self, msg: SchedulerMsg) -> bool:
        match msg:
            case AddRequest(request):
                self._num_adds_pending -= 1
                members = [request, *request.pending_forks]
                if taken := [r.request_id for r in members if r.request_id in self.requests]:
                    # The engine refuses a live duplicate id before intake; this guards the maps.
                    for r in members:
                        request.outputs.put_nowait(RequestOutput(
                            request_id=request.request_id, text="", token_ids=[], finished=True,
                            finish_reason="error", error=f"request id {taken[0]!r} is already in use", index=r.index,
                        ))
                    return True
                for r in members:
                    self.requests[r.request_id] = r  # the choices to fork wait outside the queues
                self._enqueue(request)
            case AbortRequest(request_id):
                # An abort follows the request it names (through intake while intake holds
                # it), so an unknown id has already left (or never existed): nothing to do.
                req = self.requests.get(request_id)
                if req is None or req.params.n > 1:  # every choice of the group still here
                    members = [r for r in self.requests.values() if r.group_id == request_id]
                else:
                    members = [req]
                for req in members:
                    if not req.is_finished:
                        self._remove(req)
                        self._finish(req, "abort")
                    elif self.policy.holds_finished(req):
                        self.release(req)  # finished but held by static batching: let it go now
                        self.policy.forget(req)
            case Shutdown(reason):
                self._fail_all(reason)
                return False
        return True

    # --- what the plan view offers the policies ---------------------------------------

    def grow(self, req: Request, num_new_tokens: int, decisions: list[Decision]) -> bool:
        while not self.ledger.grow(req.request_id, req.num_computed_tokens + num_new_tokens):
            victim = max(self.running, key=lambda r: r.sort_key)  # lowest priority, newest
            self._preempt(victim)
            decisions[:] = [d for d in decisions if d.request is not victim]
            if victim is req:
                return False
        return True

    def admit(self, req: Request, max_new_tokens: int, min_new_tokens: int) -> int:
        # a request scoring its prompt must compute every prompt position: no prefix-cache hits
        lookup = self.policy.uses_prefix_cache and req.params.prompt_logprobs is None
        n = self.ledger.admit(req.request_id, req.all_token_ids, lookup,
                              min(max_new_tokens, req.num_tokens), min(min_new_tokens, req.num_tokens),
                              req.params.cache_salt, counted=req.num_preemptions == 0)
        if n:
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
        return n

    def release(self, req: Request, new_tokens: list[int] | None = None) -> None:
        """A finished request leaves: free its blocks, deliver its final output."""
        self.ledger.free(req.request_id)
        self.requests.pop(req.request_id, None)
        emit(req, new_tokens or [], final=True)
        now = self.clock()
        scheduled, first = req.scheduled_time, req.first_token_time
        self._finished.append(FinishedRequest(
            req.request_id, req.finish_reason or "abort", now - req.arrival_time,
            req.num_prompt_tokens, len(req.output_token_ids),
            queue_s=scheduled - req.arrival_time if scheduled is not None else None,
            prefill_s=first - scheduled if first is not None and scheduled is not None else None,
            decode_s=now - first if first is not None else None,
        ))

    # --- state changes ----------------------------------------------------------------

    def _age_waiting(self) -> None:
        """Priority aging: a waiting request gains one priority level (a lower number) per
        `priority_aging_s` seconds waited, so steady high-priority load cannot starve it."""
        now = self.clock()
        self.waiting.sort(key=lambda r: (r.params.priority - int((now - r.arrival_time) / self.priority_aging_s),
                                         r.arrival))

    def _enqueue(self, req: Request) -> None:
        req.status = Status.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.ledger.free(req.request_id)
        self.policy.forget(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted_this_step = True
        self._enqueue(req)

    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.policy.forget(req)

    def _finish(self, req: Request, reason: str, error: str | None = None, new_tokens: list[int] | None = None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        forks, req.pending_forks = req.pending_forks, []
        for child in forks:  # never forked (ended before its prompt was prefilled): they end with it
            if not child.is_finished:
                self._finish(child, reason, error)
        if reason not in ("abort", "error") and self.policy.holds_finished(req):
            emit(req, new_tokens or [], final=False)  # static batching: final output when the batch ends
            return
        self.release(req, new_tokens)

    def _fail_all(self, reason: str) -> None:
        for req in list(self.requests.values()):
            if req.request_id not in self.requests:
                continue  # a pending fork that ended with its group just now
            self._remove(req)
            if req.is_finished:
                self.release(req)  # held by static batching
            else:
                self._finish(req, "error", reason)

    # --- settle, plan and update ------------------------------------------------------

    def _settle(self, decisions: list[Decision], grant: KVGrant) -> list[Decision]:
        """Apply the block manager's answer: admissions get their prefix hits (and maybe fewer
        tokens, or none), refused growths are preempted. Returns the decisions that run."""
        self.ledger.apply(grant)
        for request_id in grant.refused:
            self._preempt(self.requests[request_id])
        kept, hits = [], []  # hits: admissions that start after prefix-cache hits
        for d in decisions:
            req = d.request
            got = grant.admitted.get(req.request_id)
            hit = got is not None and got.num_cached_tokens > 0
            if got is not None:
                if not got.num_new_tokens:  # no room after all: back to waiting, as it was
                    self.running.remove(req)
                    self.policy.forget(req)
                    self._enqueue(req)
                    continue
                req.num_computed_tokens = got.num_cached_tokens
                d.num_tokens = got.num_new_tokens
                if req.scheduled_time is None:  # granted: its queue time ends (not when planned: may be refused)
                    req.scheduled_time = self.clock()
                self._cached_this_step += got.num_cached_tokens  # compute saved, a preempted one's own blocks too
                if req.num_preemptions == 0:  # a first lookup (vLLM leaves a preempted one's out of its hit rate)
                    req.num_cached_tokens = got.num_cached_tokens
                    self._hit_this_step += got.num_cached_tokens
                    if self.policy.uses_prefix_cache and req.params.prompt_logprobs is None:
                        self._queried_this_step += req.num_tokens
            if d.num_tokens and req.status is not Status.RUNNING:
                continue  # preempted just now
            kept.append(d)
            if hit:
                hits.append(d)
        self.policy.granted(kept, hits, self.view)  # e.g. chunked: a chunk after a hit costs more than planned
        return kept

    def _make_plan(self, decisions: list[Decision]) -> StepPlan:
        self.step += 1
        items = []
        for d in decisions:
            req = d.request
            start = req.num_computed_tokens
            table = self.ledger.tables[req.request_id]
            if d.num_tokens == 0:  # a finished request's place in a static batch
                items.append(PlanItem(
                    request_id=req.request_id, kind="padding", token_ids=[self.pad_token_id] * d.num_padding,
                    start_pos=start, block_table=table, sample=False, num_padding=d.num_padding,
                ))
                continue
            sample = start + d.num_tokens == req.num_tokens
            kind = "decode" if req.decodes(d.num_tokens) else "prefill"
            tokens = req.token_slice(start, start + d.num_tokens)
            if d.num_padding:
                tokens += [self.pad_token_id] * d.num_padding
            items.append(PlanItem(
                request_id=req.request_id, kind=kind, token_ids=tokens,
                start_pos=start, block_table=table, sample=sample, num_padding=d.num_padding,
                **sampling_fields(req, start, d.num_tokens, sample),
            ))
        cached, self._cached_this_step = self._cached_this_step, 0
        queried, self._queried_this_step = self._queried_this_step, 0
        hit, self._hit_this_step = self._hit_this_step, 0
        shape = items_shape(items)
        return StepPlan(step=self.step, items=items, token_budget=self.policy.token_budget, num_cached_tokens=cached,
                        num_prefix_queries=queried, num_prefix_hits=hit, block_copies=self.ledger.take_copies(), shape=shape,
                        predicted_s=self.cost.predict(shape) if self.cost.is_fitted else None)

    def _update(self, decisions: list[Decision], result: StepResult) -> tuple[list[float], list[float]]:
        if result.error is not None:
            # Nothing of a failed step is committed: its KV may never have been written, and a
            # committed block would be handed to later requests with the same prefix.
            self.consecutive_failures += 1
            for d in decisions:
                if d.request.status is Status.RUNNING:
                    self._remove(d.request)
                    self._finish(d.request, "error", result.error)
            if self.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                self.dead = f"executor failed {self.consecutive_failures} steps in a row: {result.error}"
            return [], []
        self.consecutive_failures = 0
        commits = []
        block_size = self.ledger.block_size
        for d in decisions:
            req = d.request
            if d.num_tokens == 0 or req.status is not Status.RUNNING:
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens += d.num_tokens
            # The pool hashes full blocks only, and every earlier one is hashed already (by an
            # earlier commit, or found as a prefix hit): a step that filled none has no commit.
            if req.num_computed_tokens // block_size > before // block_size:
                commits.append((req.request_id, req.all_token_ids, req.num_computed_tokens))
        self.ledger.commit(commits)
        for d in decisions:
            if d.request.pending_forks and d.request.request_id in result.sampled:
                self._fork(d.request)
        for request_id, why in result.failed.items():  # rows left with nothing to sample: these alone end
            req = self.requests.get(request_id)
            if req is not None and req.status is Status.RUNNING:
                self._remove(req)
                self._finish(req, "error", why)
        stopped, ttft, itl = self.outputs.process(self.requests, result)
        for req, reason, token in stopped:
            self.running.remove(req)
            self._finish(req, reason, new_tokens=[token])
        return ttft, itl

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is prefilled and the step sampled every choice's first token:
        the other choices start from its KV blocks, computed up to where it is."""
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.scheduled_time = parent.scheduled_time  # the group's prompt was scheduled for it too
            child.status = Status.RUNNING
            child.prompt_logprobs_sent = True  # the group's prompt logprobs go with choice 0's first output
            self.running.append(child)
            self.ledger.fork(parent.request_id, child.request_id, parent.num_computed_tokens)
        self.policy.forked(parent, children)

    # --- publishing -------------------------------------------------------------------

    async def _idle(self) -> None:
        """Nothing runs: send the KV changes still pending (frees of requests that ended) and
        publish requests that ended meanwhile (e.g. aborted while waiting) at once, in a record
        of the last step's number with no items."""
        if self.ledger.has_changes:
            self.ledger.apply(await self.kv.step(self.ledger.take()))
        if not self._finished:
            return
        self.publish(StepRecord(
            step=self.step, start_time=time.time(), duration_s=0.0, forward_s=0.0, policy=self.policy.name,
            token_budget=self.policy.token_budget, items=[], num_prefill_tokens=0, num_decode_tokens=0,
            num_padding_tokens=0, num_cached_tokens=0, num_waiting=len(self.waiting), num_running=len(self.running),
            kv_usage=self.ledger.usage, num_preemptions=self.num_preemptions, finished=self._finished,
        ))
        self._finished = []

    def _publish(self, plan: StepPlan, result: StepResult, latencies: tuple[list[float], list[float]]) -> None:
        kinds = {"prefill": 0, "decode": 0, "padding": 0}
        items = []
        for it in plan.items:
            n = len(it.token_ids) - it.num_padding
            if n:
                kinds[it.kind] += n
                items.append(StepItem(it.request_id, it.kind, n, it.start_pos))
            if it.num_padding:
                kinds["padding"] += it.num_padding
                items.append(StepItem(it.request_id, "padding", it.num_padding, it.start_pos + n))
        self.publish(StepRecord(
            step=plan.step, start_time=result.start_time, duration_s=result.duration_s, forward_s=result.forward_s,
            policy=self.policy.name,
            token_budget=plan.token_budget, items=items, num_prefill_tokens=kinds["prefill"],
            num_decode_tokens=kinds["decode"], num_padding_tokens=kinds["padding"],
            num_cached_tokens=plan.num_cached_tokens, num_waiting=len(self.waiting), num_running=len(self.running),
            kv_usage=self.ledger.usage, num_preemptions=self.num_preemptions, ttft_s=latencies[0],
            itl_s=latencies[1], finished=self._finished, error=result.error, predicted_s=plan.predicted_s,
            num_prompt_tokens=self.outputs.num_prompt_tokens, num_prefix_queries=plan.num_prefix_queries,
            num_prefix_hits=plan.num_prefix_hits,
        ))
        self.outputs.num_prompt_tokens = 0
        self._finished = []

    @property
    def snapshot(self) -> EngineSnapshot:
        """The queues and KV figures now, built when asked (the monitor, /v1/engine/state) rather
        than every step: it costs a struct per queued request. Other tasks read it only while
        the scheduler awaits (the inbox, the block manager, the executor), so it is never torn."""
        figures = self.kv.figures

        def snap(r: Request) -> RequestSnapshot:
            return RequestSnapshot(
                request_id=r.request_id, status=r.status.value, num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=r.num_computed_tokens, num_generated_tokens=len(r.output_token_ids),
                max_tokens=r.params.max_tokens, priority=r.params.priority,
            )

        return EngineSnapshot(
            policy=self.policy.name, step=self.step, running=[snap(r) for r in self.running],
            waiting=[snap(r) for r in self.waiting], kv_usage=self.ledger.usage, num_blocks=figures.num_blocks,
            num_free_blocks=self.ledger.num_free_blocks, num_preemptions=self.num_preemptions,
            prefix_cache_hit_rate=figures.hit_rate,
        )


def plan_shape(plan: StepPlan) -> StepShape:
    """What the cost model sees of a plan: the scheduler's plans carry it, a hand-made one
    (start-up calibration) is measured here."""
    return plan.shape if plan.shape is not None else items_shape(plan.items)


def items_shape(items: list[PlanItem]) -> StepShape:
    """Pad tokens are computed too: they count."""
    return shape_of([(len(it.token_ids), it.start_pos, it.kind == "decode") for it in items])
