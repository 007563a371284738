"""The intake actor: validates and tokenizes requests, then hands them to the scheduler.

Everything that can be refused is refused here, before a request touches the engine: bad
sampling parameters, an empty or too long prompt, a prompt that could never fit the KV
pool, a full waiting queue, a JSON schema the grammar compiler refuses. Long prompts are
tokenized on a worker thread; grammars are compiled on another (engine/structured/compiler.py),
each request with a schema waiting for it in its own task, so that the requests behind it are
admitted meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.admission import check_fits, check_prompt_ids, check_room
from engine.chat_prompt import prompt_ids
from engine.detokenizer import Detokenizer
from engine.errors import EngineDeadError, RequestAbortedError, RequestError
from engine.messages import AbortRequest, IntakeMsg, Shutdown, Submit
from engine.request import CHOICE_SEPARATOR, Request, choice_seed
from engine.structured.compiler import GrammarCache


class Intake:
    def __init__(
        self,
        tokenizer,
        add: Callable[[Request], None],
        abort: Callable[[str], None],
        max_model_len: int,
        kv_capacity_tokens: int,
        max_waiting: int,
        num_waiting: Callable[[], int],
        seed: int = 0,
        eos_token_ids: frozenset[int] | None = None,  # default: the tokenizer's EOS
        vocab_size: int | None = None,  # the model's logits width (default: the tokenizer's size)
        max_num_seqs: int | None = None,  # n > this could never be scheduled at once
    ):
        self.tokenizer = tokenizer
        self.add = add  # hands an accepted request to the scheduler
        self.abort = abort  # passes an abort on to the scheduler, after the request it names
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_waiting = max_waiting
        self.num_waiting = num_waiting
        self.max_num_seqs = max_num_seqs
        self.vocab_size = len(tokenizer)
        if eos_token_ids is None:
            eos_token_ids = frozenset() if tokenizer.eos_token_id is None else frozenset([tokenizer.eos_token_id])
        self.eos_token_ids = eos_token_ids
        self.grammars = GrammarCache(tokenizer, vocab_size or self.vocab_size, eos_token_ids)
        self.inbox: asyncio.Queue[IntakeMsg] = asyncio.Queue()
        self._arrivals = itertools.count()
        self._seeds = random.Random(seed)  # [model] seed: requests without a seed still sample reproducibly
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepwise-tokenize")
        self._compiling: dict[str, asyncio.Task] = {}  # request id -> its task, on its way to its grammar
        self._aborted: set[str] = set()  # of those, the ones Engine.abort cancelled (the others: the engine stops)
        self.num_compiling = 0  # those past the queue check, not yet handed over: they count as waiting

    async def run(self) -> None:
        try:
            while True:
                match await self.inbox.get():
                    case Submit() as msg if getattr(msg.params, "structured_output", None) is not None:
                        # A schema may take seconds (or minutes) to compile: the requests behind
                        # it are admitted meanwhile, as vLLM's wait for their grammar apart.
                        task = asyncio.create_task(self._handle(msg), name=f"stepwise-grammar-{msg.request_id}")
                        self._compiling[msg.request_id] = task
                        task.add_done_callback(functools.partial(self._compiled, msg))
                    case Submit() as msg:
                        await self._handle(msg)
                    case AbortRequest(request_id):
                        # Sent here while intake held the Submit it names, so it comes after it: a
                        # request still waiting for its grammar is refused now; any other has
                        # reached the scheduler, and the abort follows it there.
                        task = self._compiling.pop(request_id, None)
                        if task is not None and task.cancel():  # (a task already done has added it)
                            self._aborted.add(request_id)
                        self.abort(request_id)
                    case Shutdown():
                        return
        finally:
            for task in self._compiling.values():
                task.cancel()
            self._thread.shutdown(wait=False)

    def _compiled(self, msg: Submit, task: asyncio.Task) -> None:
        if self._compiling.get(msg.request_id) is task:  # not a later request of the same id
            del self._compiling[msg.request_id]
        if task.cancelled():  # cancelled before it ever ran, _handle never answered
            self._answer_cancelled(msg)

    def _answer_cancelled(self, msg: Submit) -> bool:
        """Answer a request cancelled in intake: aborted (True), or the engine stops."""
        aborted = msg.request_id in self._aborted
        self._aborted.discard(msg.request_id)
        if not msg.reply.done():
            msg.reply.set_exception(
                RequestAbortedError(f"request {msg.request_id!r} was aborted while it waited for its grammar")
                if aborted else EngineDeadError("engine stopped"))
        return aborted

    async def _handle(self, msg: Submit) -> None:
        try:
            request = await self._admit(msg)
        except asyncio.CancelledError:  # aborted, or the engine stops, while the grammar compiles
            if self._answer_cancelled(msg):
                return
            raise
        except Exception as e:  # refused: the caller gets the reason
            if not msg.reply.done():
                msg.reply.set_exception(e)
            return
        self.add(request)
        if not msg.reply.done():
            msg.reply.set_result(None)

    async def _admit(self, msg: Submit) -> Request:
        msg.params.validate()
        if self.max_num_seqs is not None and msg.params.n > self.max_num_seqs:
            raise RequestError(f"n={msg.params.n} is more than the {self.max_num_seqs} sequences a step may run "
                               "(max_num_seqs)", "n")
        check_room(self.num_waiting() + self.num_compiling, self.max_waiting)
        if msg.params.structured_output is None:
            return await self._build(msg)
        # Schema requests are admitted in parallel tasks: each counts as waiting from its check
        # on, so that the next one's check sees it (it also waits to tokenize, then to compile).
        self.num_compiling += 1
        try:
            return await self._build(msg)
        finally:
            self.num_compiling -= 1

    async def _build(self, msg: Submit) -> Request:
        ids = await prompt_ids(self.tokenizer, msg.prompt, msg.messages, self._thread)
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        check_prompt_ids(ids, self.vocab_size)
        check_fits(len(ids), msg.params.max_tokens, self.max_model_len, self.kv_capacity_tokens)
        if any(t >= self.vocab_size for t in msg.params.logit_bias):
            raise RequestError(f"logit_bias keys must be token ids in [0, {self.vocab_size})", "logit_bias")
        if any(t >= self.vocab_size for t in msg.params.stop_token_ids):  # could never stop the request
            raise RequestError(f"stop_token_ids must be token ids in [0, {self.vocab_size})", "stop_token_ids")
        seed = msg.params.seed if msg.params.seed is not None else self._seeds.getrandbits(62)
        arrival = next(self._arrivals)
        compiled = None
        if msg.params.structured_output is not None:
            compiled = await self.grammars.get(msg.params.structured_output)

        def choice(index: int) -> Request:  # n > 1: each choice its own stream, seed and grammar state
            request_id = msg.request_id if index == 0 else f"{msg.request_id}{CHOICE_SEPARATOR}{index}"
            detok = Detokenizer(self.tokenizer, ids, list(msg.params.stop), msg.params.min_tokens,
                                msg.params.include_stop_str_in_output)
            grammar = self.grammars.matcher(compiled) if compiled is not None else None
            return Request(request_id, ids, msg.params, detok, self.eos_token_ids, arrival, msg.outputs,
                           choice_seed(seed, index), grammar, index, msg.request_id, msg.arrival_time)

        request = choice(0)
        request.pending_forks = [choice(i) for i in range(1, msg.params.n)]
        return request
