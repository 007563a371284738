"""What a policy returns to the scheduler, and the interface every policy implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler import Scheduler


@dataclass
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
    token_budget: int
    uses_prefix_cache: bool

    async def schedule(self, s: Scheduler) -> list[Decision] | Idle:
        ...

    def hold_finished(self, request: Request) -> bool:
        """True: keep a finished request (and its blocks) until the policy releases it."""
        ...

    def forget(self, request: Request) -> None:
        """The request left (aborted, failed or preempted): drop any reference to it."""
        ...

    def end_step(self, s: Scheduler) -> None:
        """After a step's results are applied (e.g. static releases a batch that is done)."""
        ...
