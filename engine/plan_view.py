"""The narrow view a batching policy plans a step through.

A policy sees the queues in order and asks for KV room; it never touches the scheduler's
state directly. Everything here is synchronous: room comes from the scheduler's `KVLedger`,
and the whole step's KV changes go to the block manager in one message after planning.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING

from engine.request import Status
from engine.step_cost import shape_of

if TYPE_CHECKING:
    from engine.policies.base import Decision
    from engine.request import Request
    from engine.scheduler import Scheduler
    from engine.step_cost import StepShape


class PlanView:
    def __init__(self, scheduler: Scheduler):
        self._s = scheduler

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests, the next to admit first (priority, then arrival; aging applied)."""
        return self._s.waiting

    @property
    def num_running(self) -> int:
        """Sequences running, counting the choices still to fork from a running request (n > 1)."""
        return sum(r.num_seqs for r in self._s.running)

    @property
    def preempted(self) -> bool:
        """Someone was preempted while planning this step: admit nobody new in it."""
        return self._s.preempted_this_step

    def now(self) -> float:
        return self._s.clock()

    @property
    def can_predict(self) -> bool:
        """The step-cost model has been fitted (calibration or real steps)."""
        return self._s.cost.is_fitted

    def predict(self, shape: StepShape) -> float:
        """Predicted forward seconds of a step of this shape."""
        return self._s.cost.predict(shape)

    def shape(self, decisions: Iterable[Decision]) -> StepShape:
        """The shape of a step made of these decisions, as the plan will have it."""
        return shape_of((d.num_tokens + d.num_padding, d.request.num_computed_tokens, d.request.decodes(d.num_tokens))
                        for d in decisions)

    def running_in_order(self) -> list[Request]:
        return sorted(self._s.running, key=attrgetter("sort_key"))

    def is_running(self, req: Request) -> bool:
        """Still running (planning may preempt a request it saw in the queue)."""
        return req.status is Status.RUNNING

    def grow(self, req: Request, num_new_tokens: int, decisions: list[Decision]) -> bool:
        """Room for a running request's next tokens, preempting the lowest-priority newest
        running request (taking back its decision) while there is none. False: `req` itself
        was preempted."""
        return self._s.grow(req, num_new_tokens, decisions)

    def admit(self, req: Request, max_new_tokens: int, min_new_tokens: int = 1) -> int:
        """Start the head of the waiting queue with up to `max_new_tokens` tokens (at least
        `min_new_tokens`); returns how many were planned (0 = no room). The block manager may
        grant fewer — never more — once it knows the request's prefix-cache hits."""
        return self._s.admit(req, max_new_tokens, min_new_tokens)

    def release(self, req: Request) -> None:
        """A finished request the policy held (static batching) leaves now."""
        self._s.release(req)
