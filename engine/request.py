"""A request's sampling parameters (a value) and its scheduling state (owned by the scheduler)."""

from __future__ import annotations

import enum
import hashlib
import re
import time

import msgspec

from engine.detokenizer import Detokenizer
from engine.errors import RequestError
from engine.output_buffer import OutputBuffer
from engine.structured.spec import StructuredOutput

MAX_N = 16  # choices per request (SamplingParams.n); intake also bounds it by max_num_seqs
CHOICE_SEPARATOR = "#"  # choice i > 0 of request ID runs as ID#i: callers' ids may not contain it


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) that ended the output
    ignore_eos: bool = False
    priority: int = 0
    n: int = 1  # choices sampled from the one prompt (prefilled once, its KV blocks shared)
    structured_output: StructuredOutput | None = None  # constrain the output to a JSON schema
    # Logits processing (engine/logits_processors.py), all neutral by default:
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: minus this per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: prompt + generated tokens' logits divided (>0) or multiplied (<0) by it
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    # Logprobs of the raw model distribution (before temperature, penalties, bias):
    logprobs: int | None = None  # per generated token: its logprob and the top-k (0 = just its own)
    prompt_logprobs: int | None = None  # per prompt token (the first has none); disables prefix-cache hits
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests with the same salt

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Refuse a field of the wrong type (as the HTTP API's typed decoding does: a library
        caller's `seed=True` or `stop="x"` must not reach the scheduler) or out of range,
        raising RequestError naming it."""
        _check_types(self)  # below, every field has its declared type: only ranges are left to check
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # a signed 64-bit integer, as vLLM's
            raise RequestError(f"seed must be a 64-bit integer, in [-2^63, 2^63), got {self.seed!r}", "seed")
        if not all(self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if len(self.stop) > 16:
            raise RequestError("at most 16 stop strings", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.structured_output is not None:
            self.structured_output.validate()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails every range
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}", name)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise RequestError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}",
                               "repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
                                   "logit_bias")
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                               "min_tokens")
        if self.min_tokens and self.structured_output is not None:  # a value ended early could sample nothing
            raise RequestError(f"min_tokens cannot be combined with structured output ({self.structured_output.param}):"
                               " the grammar decides where the output ends", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)
        if self.cache_salt is not None and not self.cache_salt:
            raise RequestError("cache_salt must be a non-empty string (or absent)", "cache_salt")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")


MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
_FIELD = re.compile(r"`\$\.(\w+)")  # the field in msgspec's path: "at `$.seed`", "at `key` in `$.logit_bias`"


def _check_types(params: SamplingParams) -> None:
    """Every field has its declared type (a bool is not an int, an int is a float), checked by
    msgspec as the HTTP API's decoding checks it."""
    if isinstance(params.stop, str):
        raise RequestError(f"stop must be a list of strings, got the string {params.stop!r} (wrap it in a list)",
                           "stop")
    if params.structured_output is not None and not isinstance(params.structured_output, StructuredOutput):
        raise RequestError(f"structured_output must be a StructuredOutput (e.g. StructuredOutput.from_schema(...)), "
                           f"got {type(params.structured_output).__name__}", "structured_output")
    fields = {name: _plain(value) for name, value in msgspec.structs.asdict(params).items()}
    try:
        msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as e:
        field = _FIELD.search(str(e))
        raise RequestError(f"invalid sampling parameter: {e}", field.group(1) if field else None) from None


def _plain(value: object) -> object:
    """A subclass of float or int (numpy.float64, an IntEnum) as the plain number it is: msgspec
    takes only exact types, and such values always passed here before."""
    if isinstance(value, float) and type(value) is not float:
        return float(value)
    if isinstance(value, int) and not isinstance(value, bool) and type(value) is not int:
        return int(value)
    return value


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: choice 0 keeps it (so it
    samples what an n=1 request would), the others get distinct deterministic derivatives."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # [0, 2^63)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Mutable scheduling state. Owned by the scheduler actor from the moment intake hands it
    over; others see it only through published snapshots and RequestOutputs.

    A request with n > 1 is a group of n of these, one per choice, sharing one output buffer
    (their outputs carry `index`). Choice 0 has the group's id and runs the prompt; the others
    (`group_id#i`) wait in its `pending_forks` until its prefill samples their first tokens,
    then run on their own from a fork of its KV blocks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: Detokenizer,
        eos_token_ids: frozenset[int] | None,
        arrival: int,
        outputs: OutputBuffer | None = None,
        seed: int | None = None,
        grammar: object | None = None,
        index: int = 0,
        group_id: str | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.index = index  # the choice this request is (0 unless n > 1)
        self.group_id = group_id or request_id  # the id its outputs carry
        self.pending_forks: list[Request] = []  # choices to fork from this one once its prompt is prefilled
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids or frozenset()  # any of them ends the request (unless ignore_eos)
        # the token ids that end it when sampled (masked while under min_tokens)
        self.stop_ids = (frozenset() if params.ignore_eos else self.eos_token_ids) | frozenset(params.stop_token_ids)
        self.arrival = arrival  # monotonic counter: FCFS order and "newest" for preemption
        self.sort_key = (params.priority, arrival, index)  # the queues' order (all three never change)
        # submitted (the engine's, before tokenizing and any grammar compile), else now
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None  # first admitted
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.outputs = outputs if outputs is not None else OutputBuffer()  # bounded: a slow reader gets coalesced deltas
        self.seed = seed if seed is not None else params.seed  # None: drawn from torch's RNG on first use
        self._generator = None
        # xgrammar GrammarMatcher when params.structured_output is set (engine/structured: the
        # executor masks and advances it during a step; the scheduler reads it between steps)
        self.grammar = grammar
        # logprobs (when params ask): the prompt's, positions 1.. as prefill scores them; the
        # generated tokens' not yet emitted; whether the prompt's went out (with the first output)
        self.prompt_logprobs: list = []  # [TokenLogprob]
        self.pending_logprobs: list = []  # [TokenLogprob]
        self.prompt_logprobs_sent = False
        self.fixed_sampling: dict | None = None  # the PlanItem fields that never change (plan_sampling)

    @property
    def generator(self):
        """The request's torch.Generator, made on first use. A greedy request samples nothing
        at random, so it never makes one: the simulator runs the real scheduler without torch."""
        if self._generator is None and self.params.temperature > 0:
            import torch  # here, not at the top: the messages (and so the monitor) import this module

            if self.seed is None:
                self.seed = int(torch.randint(0, 2**62, ()).item())
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def decodes(self, num_new_tokens: int) -> bool:
        """Would its next `num_new_tokens` tokens be a decode: one, its last known token, after
        it has sampled (else they are a prompt chunk, or a recomputation after a preemption)?"""
        return num_new_tokens == 1 and self.num_computed_tokens + 1 == self.num_tokens and bool(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without building the whole list (a decode's one token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def num_seqs(self) -> int:
        """Sequences it will run as (itself and the choices still to fork from it)."""
        return 1 + len(self.pending_forks)


    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def ends_on(self, token: int) -> bool:
        """After appending `token`: is it one that ends the request (EOS, a stop token id)?"""
        if len(self.output_token_ids) < self.params.min_tokens:
            return False  # its stop ids were masked
        return token in self.stop_ids

    def stop_reason(self) -> str | None:
        """After appending a token: why the request should stop, if it should."""
        if len(self.output_token_ids) < self.params.min_tokens:
            return None  # its stop ids were masked; stop strings wait too (as vLLM)
        if self.ends_on(self.output_token_ids[-1]) or self.detokenizer.hit_stop:
            return "stop"
        if self.grammar is not None and self.grammar.is_terminated():
            return "stop"  # the output is complete (reached even with ignore_eos)
        if len(self.output_token_ids) >= self.params.max_tokens:
            return "length"
        return None
