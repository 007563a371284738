"""What a policy returns to the scheduler, the interface every policy implements, the
registry that names them, and the admission loop they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.plan_view import PlanView
    from engine.request import Request


@dataclass(slots=True)
class Decision:
    """Give `request` its next `num_tokens` tokens this step, then `num_padding` pad tokens in
    the same sequence (static batching: they attend to the request's context at the positions
    they occupy, as a padded batch computes them; their KV is not stored, nothing is sampled
    from them)."""

    request: Request
    num_tokens: int
    num_padding: int = 0


@dataclass
class Idle:
    """Nothing to run until a message arrives or `timeout_s` passes."""

    timeout_s: float | None = None


class Policy(Protocol):
    name: str
    token_budget: int  # 0 = no per-step token budget
    uses_prefix_cache: bool

    def schedule(self, view: PlanView) -> list[Decision] | Idle:
        """Plan the next step: decisions over the view's queues, KV room asked of the view."""
        ...

    def holds_finished(self, request: Request) -> bool:
        """True: keep a finished request (and its blocks) until the policy releases it."""
        ...

    def forget(self, request: Request) -> None:
        """The request left (aborted, failed or preempted): drop any reference to it."""
        ...

    def granted(self, decisions: list[Decision], hits: list[Decision], view: PlanView) -> None:
        """The block manager answered: `hits` (of `decisions`, oldest first) are admissions that
        start after prefix-cache hits. A policy may lower a decision's tokens here (never to 0,
        never raise them)."""
        ...

    def end_step(self, view: PlanView) -> None:
        """After a step's results are applied (e.g. static releases a batch that is done)."""
        ...

    def forked(self, request: Request, children: list[Request]) -> None:
        """n > 1: `children` (other choices of `request`) start running from its prefilled prompt."""
        ...


class BasePolicy:
    """Defaults for the hooks most policies do not need."""

    token_budget = 0
    uses_prefix_cache = True

    def holds_finished(self, request: Request) -> bool:
        return False

    def forget(self, request: Request) -> None:
        pass

    def granted(self, decisions: list[Decision], hits: list[Decision], view: PlanView) -> None:
        pass

    def end_step(self, view: PlanView) -> None:
        pass

    def forked(self, request: Request, children: list[Request]) -> None:
        pass


POLICIES: dict[str, type] = {}  # name -> class; filled by @register as engine.policies loads


def register(cls: type) -> type:
    POLICIES[cls.name] = cls
    return cls


def admit_waiting(
    view: PlanView, decisions: list[Decision], max_num_seqs: int, *, budget: int | None = None,
    chunk_size: int | None = None, size: Callable[[Request, int], int] | None = None,
) -> int:
    """Admit waiting requests in order while there is room. Each starts with as many of its
    tokens as `chunk_size` and the remaining `budget` allow (None: no limit; then it is all or
    nothing: a whole prompt or not yet); `size(req, n)` may lower that further (e.g. to what a
    step-time budget allows). Stops at the first that does not fit, and after a preemption
    this step (room just made goes to running requests, not newcomers). A request with n > 1
    choices counts as n sequences against `max_num_seqs`. Returns the number of tokens admitted."""
    total = 0
    while view.waiting and view.num_running < max_num_seqs and not view.preempted:
        req = view.waiting[0]
        if view.num_running + req.num_seqs > max_num_seqs:
            break
        n = req.num_tokens
        if chunk_size is not None:
            n = min(n, chunk_size)
        if budget is not None:
            n = min(n, budget - total)
        if size is not None and n > 0:
            n = size(req, n)
        if n <= 0:
            break
        whole = chunk_size is None and budget is None
        got = view.admit(req, n, n if whole else 1)
        if got == 0:
            break
        decisions.append(Decision(req, got))
        total += got
    return total
