"""Typed messages between the actors, and the public records they publish.

Inbox messages are msgspec Structs grouped in tagged unions and dispatched with `match`.
Some carry a reply `asyncio.Future` or a live `Request` object: those never leave the
process, so they are plain Python references inside the Struct.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal, NamedTuple

import msgspec

from engine.output_buffer import OutputBuffer
from engine.request import Request, SamplingParams
from engine.step_cost import StepShape

# --- public records (serialisable: the HTTP frontend streams them as JSON) ------------------


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's log-probability under the model's raw distribution (before temperature,
    penalties and bias), and the most likely alternatives at its position."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] = []  # the k most likely (token id, logprob), most likely first


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
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids (params.logprobs set)
    prompt_logprobs: list[TokenLogprob] | None = None  # every prompt token, once, with the first output
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
    e2e_s: float  # arrival (submit) to final output
    num_prompt_tokens: int  # each choice of an n > 1 request has the whole prompt
    num_generated_tokens: int
    # each phase's time, None where the request never reached it (aborted while waiting, or
    # before its first token)
    queue_s: float | None = None  # arrival to first scheduled
    prefill_s: float | None = None  # first scheduled to first token
    decode_s: float | None = None  # first token to the end


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
    num_prompt_tokens: int = 0  # prompt tokens of the requests whose prefill completed this step (first token)
    # tokens of this step's first admissions looked up in the prefix cache, and found there (a
    # preempted request finding its own blocks again is in num_cached_tokens, not in these)
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0

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
    num_waiting_for_grammar: int = 0  # accepted by intake, their JSON schema still compiling
    num_arriving: int = 0  # handed to the scheduler while a step runs: in `waiting` at its next turn


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
    grammar: Any = None  # the request's xgrammar GrammarMatcher (structured output), advanced by the executor
    # Logits processing and logprobs (engine/logits_processors.py, engine/logprobs.py); set only
    # on items that sample (prompt_targets: on prefill items), defaults cost the sampler nothing.
    min_p: float = 0.0
    penalties: Penalties | None = None
    logit_bias: TokenBias | None = None  # -inf also masks EOS/stop ids under min_tokens
    logprobs: int = -1  # top-k alternatives wanted with the sampled token's logprob (-1: none)
    prompt_logprobs: int = -1  # the same for the prompt targets below
    prompt_targets: list[int] = []  # prompt ids at start_pos + 1 ..: the logits of this item's rows score them
    # n > 1: the group's other choices, sampled from this item's row once its prompt is prefilled,
    # each with its own (request id, generator, grammar matcher) and its own token in the result
    forks: list[tuple[str, Any, Any]] = []


class TokenBias(msgspec.Struct, frozen=True):
    """One request's logit bias as tensors, made once for the request, not per step (a bias on
    the whole vocabulary with n=16 used to become ~800,000 Python tuples every step: ~2 s a step
    for everyone in the batch)."""

    token_ids: Any  # [k] int64
    biases: Any  # [k] float32; -inf bans a token

    @classmethod
    def of(cls, pairs: list[tuple[int, float]]) -> TokenBias:
        import torch  # here: the monitor and the simulator read these messages without torch

        ids, values = zip(*pairs) if pairs else ((), ())
        return cls(torch.tensor(ids, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))

    def masking(self, token_ids: list[int]) -> TokenBias:
        """This bias with `token_ids` banned as well (min_tokens' EOS and stop ids)."""
        import torch

        return TokenBias(torch.cat([self.token_ids, torch.tensor(token_ids, dtype=torch.int64)]),
                         torch.cat([self.biases, torch.full((len(token_ids),), -math.inf)]))

    def __len__(self) -> int:
        return self.token_ids.numel()


class Penalties(msgspec.Struct, frozen=True, kw_only=True):
    """One request's penalties and the tokens they count (copies taken when the plan is made)."""

    presence: float
    frequency: float
    repetition: float
    output_token_ids: list[int]
    prompt_token_ids: list[int]  # empty unless repetition != 1 (only it looks at the prompt)


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    items: list[PlanItem]
    token_budget: int
    num_cached_tokens: int = 0
    num_prefix_queries: int = 0  # tokens looked up in the prefix cache for this step's first admissions
    num_prefix_hits: int = 0  # ... and found there
    predicted_s: float | None = None  # the step-cost model's forward time (None: not fitted yet)
    shape: StepShape | None = None  # what the cost model sees of it (set by the scheduler; None: a hand-made plan)
    block_copies: list[tuple[int, int]] = []  # (src, dst) KV blocks to copy before the forward (copy-on-write)


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    sampled: dict[str, int]  # request id -> new token
    start_time: float
    duration_s: float  # the whole step in the executor: batch building, forward, sampling
    forward_s: float = 0.0  # the model forward alone (0 when the step failed before it)
    error: str | None = None  # the step failed: every request in it ends with "error"
    failed: dict[str, str] = {}  # request id -> why its row had no token to sample: it ends with "error", the rest go on
    logprobs: dict[str, TokenLogprob] = {}  # request id -> its sampled token's, when asked for
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}  # request id -> (position of the first, entries)


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
    arrival_time: float  # time.monotonic() at submit: TTFT, e2e and queue time count intake's work


IntakeMsg = Submit | AbortRequest | Shutdown


class Execute(msgspec.Struct, tag=True):
    plan: StepPlan
    reply: asyncio.Future  # -> StepResult


ExecutorMsg = Execute | Shutdown


class StepOutcome(NamedTuple):
    """What the executor's forward and sampling of one plan gave (before the StepResult wraps it)."""

    sampled: dict[str, int]
    forward_s: float
    logprobs: dict[str, TokenLogprob] = {}
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}  # request -> (first position, entries)
    failed: dict[str, str] = {}  # request -> why none of its row's tokens could be sampled
