"""Typed messages between the actors, and the public records they publish.

Inbox messages are msgspec Structs grouped in tagged unions and dispatched with `match`.
Some carry a reply `asyncio.Future` or a live `Request` object: those never leave the
process, so they are plain Python references inside the Struct.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec

from engine.output_buffer import OutputBuffer
from engine.request import Request, SamplingParams

# --- public records (serialisable: the HTTP frontend streams them as JSON) ------------------


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    text: str  # new since the previous output
    token_ids: list[int]  # new since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    index: int = 0  # the choice (n > 1): each choice's outputs end with its own final one


Kind = Literal["prefill", "decode", "padding"]


class StepItem(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    kind: Kind
    num_tokens: int
    position: int  # position of the first token of this item


class FinishedRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    finish_reason: str
    e2e_s: float  # arrival to final output
    num_prompt_tokens: int
    num_generated_tokens: int


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    start_time: float  # unix time the step started
    duration_s: float  # in the executor: batch building + forward + sampling
    forward_s: float  # the model forward alone; the rest of a step's cycle is Python and scheduling
    policy: str
    token_budget: int
    items: list[StepItem]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padding_tokens: int
    num_cached_tokens: int  # prompt tokens skipped this step thanks to the prefix cache
    num_waiting: int
    num_running: int
    kv_usage: float  # fraction of KV blocks in use after the step
    num_preemptions: int  # cumulative
    ttft_s: list[float] = []  # time to first token of requests that got it this step
    itl_s: list[float] = []  # gaps since the previous token, for requests that decoded this step
    finished: list[FinishedRequest] = []  # requests that left since the previous record
    error: str | None = None
    predicted_s: float | None = None  # the step-cost model's forward time for this step, before it ran

    @property
    def is_idle(self) -> bool:
        """No step ran: the record only reports requests that ended meanwhile (e.g. aborted
        while waiting). It repeats the last step's number."""
        return not self.items and self.error is None


class RequestSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    status: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_generated_tokens: int
    max_tokens: int
    priority: int


class EngineSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    step: int
    running: list[RequestSnapshot]
    waiting: list[RequestSnapshot]
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_hit_rate: float


# --- the plan the scheduler hands the executor ---------------------------------------------


class PlanItem(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    kind: Kind
    token_ids: list[int]  # the tokens fed this step: the request's, then num_padding pad tokens
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # the request's blocks (pad tokens' KV is never stored)
    sample: bool  # do the request's tokens end at its last known token? (sampled after the last of them)
    num_padding: int = 0  # trailing pad tokens (static batching): computed, not stored, not sampled
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: Any = None  # the request's torch.Generator
    # (request id, generator) of more choices sampled from this row (n > 1: the group's other
    # choices, once its prompt is prefilled); each gets its own token in the result
    forks: list[tuple[str, Any]] = []


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    items: list[PlanItem]
    token_budget: int
    num_cached_tokens: int = 0
    predicted_s: float | None = None  # the step-cost model's forward time (None: not fitted yet)
    block_copies: list[tuple[int, int]] = []  # (src, dst) KV blocks to copy before the forward (copy-on-write)

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    sampled: dict[str, int]  # request id -> new token
    start_time: float
    duration_s: float  # the whole step in the executor: batch building, forward, sampling
    forward_s: float = 0.0  # the model forward alone (0 when the step failed before it)
    error: str | None = None  # the step failed: every request in it ends with "error"


# --- inboxes --------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    request: Request


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    reason: str = "shutdown"


SchedulerMsg = AddRequest | AbortRequest | Shutdown


class Submit(msgspec.Struct, tag=True):
    request_id: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    outputs: OutputBuffer  # where the scheduler will put this request's outputs
    reply: asyncio.Future  # -> None once accepted, or the exception that refused it


IntakeMsg = Submit | Shutdown


class Execute(msgspec.Struct, tag=True):
    plan: StepPlan
    reply: asyncio.Future  # -> StepResult


ExecutorMsg = Execute | Shutdown
