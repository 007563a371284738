"""The engine as an async library: wires the four actors and exposes generate/abort/steps.

    async with Engine(EngineConfig.load("config.toml")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

Actors (one asyncio task each, talking through queues): intake → scheduler ⇄ block manager,
scheduler ⇄ executor. No global state: several engines can live in one process.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from engine.attention.backend import get_backend
from engine.block_manager import BlockManager, BlockManagerClient, Stop
from engine.config import EngineConfig
from engine.errors import EngineDeadError, RequestError
from engine.executor import Executor
from engine.fanout import Fanout
from engine.intake import Intake
from engine.kv_ledger import KVLedger
from engine.kv_cache import KVCache
from engine.messages import AbortRequest, EngineSnapshot, RequestOutput, Shutdown, StepPlan, StepRecord, Submit
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model
from engine.output_buffer import OutputBuffer
from engine.policies import make_policy
from engine.request import CHOICE_SEPARATOR, MAX_N, SamplingParams
from engine.scheduler import Scheduler
from engine.step_cost import CostFigures, StepCostModel
from engine.step_cost_calibration import calibrate
from engine.torch_thread import torch_thread

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice, before any engine set one ([model] num_threads 0)
STEP_SUBSCRIBER_BUFFER = 2048


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        fault_hook: Callable[[StepPlan], None] | None = None,
    ):
        self.config = config or EngineConfig()
        self._loaded = loaded  # reuse an already loaded model (tests, benchmarks)
        self._fault_hook = fault_hook
        self._tasks: list[asyncio.Task] = []
        self._subscribers: Fanout[StepRecord] = Fanout(STEP_SUBSCRIBER_BUFFER)
        self._ids = itertools.count()
        # request id -> its outputs, from submit until the final output is taken or it is aborted
        self._live: dict[str, OutputBuffer] = {}
        self._in_intake: set[str] = set()  # submitted, not yet accepted or refused by intake
        self.ready = False
        self._started = False  # start() was called (and did not fail): an engine starts once
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop its actors run on
        self.dead: str | None = None
        self.tokenizer = None
        self.model_name = self.config.served_model_name

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> Engine:
        if self._started:
            raise RuntimeError("this engine was already started" + (" and has stopped; create a new Engine "
                               "(a loaded model can be passed on with Engine(config, loaded=...))" if self.dead else ""))
        self._started = True
        self._loop = asyncio.get_running_loop()
        # All torch work of this engine, from loading to every step, on one thread (engine/torch_thread.py)
        thread = torch_thread()
        try:
            return await self._start(thread)
        except BaseException:
            thread.shutdown(wait=False)  # the executor never took it over
            self._started = False  # nothing runs: start may be tried again
            raise

    async def _start(self, thread: ThreadPoolExecutor) -> Engine:
        cfg = self.config
        if cfg.model.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device 'cuda': this torch ({torch.__version__}) sees no CUDA device; use 'auto' or 'cpu'")
        device = torch.device("cuda" if cfg.model.device == "auto" and torch.cuda.is_available() else
                              "cpu" if cfg.model.device == "auto" else cfg.model.device)
        dtype = DTYPES[cfg.model.dtype]
        on_thread = functools.partial(asyncio.get_running_loop().run_in_executor, thread)
        # on the engine's thread, not the caller's: another engine's setting must not leak into this one
        await on_thread(torch.set_num_threads, cfg.model.num_threads or DEFAULT_THREADS)
        loaded = self._loaded or await on_thread(load_model, cfg.model.model, cfg.model.resolved_cache_dir(), dtype)
        if loaded.hf_model.dtype != dtype:  # `loaded=` a model loaded in another dtype: it would run in that one
            raise ValueError(f"[model] dtype {cfg.model.dtype!r}, but the model passed as loaded= holds "
                             f"{str(loaded.hf_model.dtype).removeprefix('torch.')} weights: load it with "
                             f"load_model(..., dtype=DTYPES[{cfg.model.dtype!r}]), or set dtype to match")
        kv_name = cfg.cache.kv_dtype_for(cfg.model.dtype)
        kv_dtype = DTYPES[kv_name]
        # may compile the kernel; refuses a backend that cannot run these dtypes
        backend = await on_thread(get_backend, cfg.model.attention_backend, device, dtype, kv_dtype)
        model = await on_thread(LlamaModel, loaded.hf_model, backend, device, cfg.model.linear_backend,
                                loaded.gguf, cfg.model.weight_format, cfg.cache.num_blocks * cfg.cache.block_size)
        self.tokenizer, name, eos_token_ids = loaded.tokenizer, loaded.name, loaded.eos_token_ids
        if self._loaded is None:
            # Our model holds copies of every weight: free transformers' copy (and unmap its
            # weight file) before the KV pool is allocated, so the two never add up.
            del loaded
            gc.collect()
        shape = model.shape
        kv_cache = await on_thread(KVCache, shape.num_layers, cfg.cache.num_blocks, cfg.cache.block_size,
                                   shape.num_kv_heads, shape.head_dim, kv_dtype, device)
        print(f"[stepwise] model {name} ({cfg.model.dtype}) on {device}, {backend.name} attention, {model.linear} linears, "
              f"{model.weight_format} weights; "
              f"KV pool {cfg.cache.num_blocks} blocks x {cfg.cache.block_size} tokens = "
              f"{kv_cache.num_bytes / 2**20:.0f} MiB ({kv_name})", file=sys.stderr)
        self.max_model_len = shape.max_position
        self.block_manager = BlockManager(cfg.cache.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        self.executor = Executor(model, kv_cache, self._fault_hook, thread)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.scheduler = Scheduler(
            make_policy(cfg.scheduler.policy, cfg), BlockManagerClient(self.block_manager),
            KVLedger(cfg.cache.num_blocks, cfg.cache.block_size), self.executor.execute, self._broadcast, pad,
            cfg.scheduler.priority_aging_s, cost=StepCostModel(split_rows=model.small_step_rows),
        )
        self.intake = Intake(
            self.tokenizer, self.scheduler.add, self.scheduler.abort, shape.max_position,
            cfg.cache.num_blocks * cfg.cache.block_size,
            cfg.scheduler.max_waiting, lambda: self.scheduler.num_queued, cfg.model.seed, eos_token_ids,
            shape.vocab_size,
            cfg.scheduler.max_num_seqs,
        )
        if cfg.scheduler.calibrate_step_cost:
            await on_thread(calibrate, self.executor, self.scheduler.cost, cfg.cache.num_blocks, shape.max_position)
        for name, actor in [("block-manager", self.block_manager), ("executor", self.executor),
                            ("scheduler", self.scheduler), ("intake", self.intake)]:
            task = asyncio.create_task(actor.run(), name=f"stepwise-{name}")
            task.add_done_callback(self._on_actor_exit)
            self._tasks.append(task)
        self.ready = True
        return self

    def _on_actor_exit(self, task: asyncio.Task) -> None:
        if self.dead:
            return
        if task.cancelled():
            self.dead = f"{task.get_name()} was cancelled"
        elif task.exception() is not None:
            self.dead = f"{task.get_name()} crashed: {task.exception()!r}"
        else:
            self.dead = self.scheduler.dead or f"{task.get_name()} stopped"
        self.ready = False
        self._fail_live(self.dead)
        self._subscribers.close()  # no step will come: steps() watchers end (with `dead` saying why)

    def _fail_live(self, reason: str) -> None:
        """End every stream still open with an error (a dead actor will never answer them);
        a stream that already got its final output is left as it is."""
        for request_id, outputs in list(self._live.items()):
            for index in outputs.open_choices():
                outputs.put_nowait(RequestOutput(
                    request_id=request_id, text="", token_ids=[], finished=True, finish_reason="error", error=reason,
                    index=index,
                ))

    async def stop(self) -> None:
        if not self._tasks:
            return
        if self._loop is not asyncio.get_running_loop() and self._loop.is_closed():
            # its loop (an earlier asyncio.run) ended and cancelled the actors: nothing to wait for
            self.ready, self.dead = False, self.dead or "engine stopped"
            self._tasks.clear()
            self._live.clear()
            return
        self._require_loop()
        self.ready = False
        self.dead = self.dead or "engine stopped"
        self.scheduler.inbox.put_nowait(Shutdown("engine stopped"))
        self.intake.inbox.put_nowait(Shutdown())
        await asyncio.wait([t for t in self._tasks if t.get_name() in ("stepwise-scheduler", "stepwise-intake")],
                           timeout=30)
        self.executor.inbox.put_nowait(Shutdown())
        self.block_manager.inbox.put_nowait(Stop())
        await asyncio.wait(self._tasks, timeout=30)
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()
        self._fail_live(self.dead)
        self._live.clear()
        self._subscribers.close()

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # --- requests -----------------------------------------------------------------------

    async def submit(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and enqueue a request; return its id. Raises RequestError,
        ContextLengthError, QueueFullError or EngineDeadError, and RequestAbortedError when
        `abort(request_id)` came while intake still held it (waiting for its grammar)."""
        self._require_loop()
        if self.dead or not self.ready:
            raise EngineDeadError(self.dead or "engine is not started")
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise RequestError(f"request_id must be a non-empty string (or None for a generated one), got "
                               f"{request_id!r}", "request_id")
        if request_id is not None and CHOICE_SEPARATOR in request_id:
            raise RequestError(f"request_id {request_id!r} contains {CHOICE_SEPARATOR!r}, which is reserved: choice i "
                               f"of an n > 1 request runs as ID{CHOICE_SEPARATOR}i", "request_id")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._live:
            raise RequestError(f"request id {request_id!r} is already in use by a live request", "request_id")
        params = params or SamplingParams()
        n = params.n if isinstance(params.n, int) and 1 <= params.n <= MAX_N else 1  # a bad n is refused by intake
        outputs = OutputBuffer(on_final=lambda: self._forget(request_id, outputs), num_choices=n)
        self._live[request_id] = outputs  # reserved now: no await between the check and this
        reply = asyncio.get_running_loop().create_future()
        self._in_intake.add(request_id)
        reply.add_done_callback(lambda _: self._in_intake.discard(request_id))
        self.intake.inbox.put_nowait(Submit(request_id, prompt, messages, params, outputs, reply, time.monotonic()))
        try:
            await asyncio.shield(reply)
        except asyncio.CancelledError:
            # The caller gave up while intake worked: if intake accepts, abort right after. The
            # id stays taken until the request is over (a retry under it would get its abort).
            outputs.abandon()  # forgotten once its final output is put, unread

            def settle(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    self._forget(request_id, outputs)
                else:
                    self.scheduler.abort(request_id)

            reply.add_done_callback(settle)
            raise
        except Exception:
            self._forget(request_id, outputs)
            raise
        if self.dead or self.scheduler.dead:
            # the scheduler died while intake handled this request: nobody would ever answer it
            self._forget(request_id, outputs)
            raise EngineDeadError(self.dead or self.scheduler.dead)
        return request_id

    def _forget(self, request_id: str, outputs: OutputBuffer) -> None:
        if self._live.get(request_id) is outputs:
            del self._live[request_id]

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs (deltas). Leaving the loop early aborts the request. With
        `params.n` > 1 the choices' outputs interleave, each tagged with its `index`; the
        stream ends after every choice's final output."""
        request_id = await self.submit(prompt, params, messages=messages, request_id=request_id)
        async for out in self.stream(request_id):
            yield out

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The outputs of a submitted request, until its final one. Leaving early aborts it."""
        self._require_loop()
        outputs = self._live.get(request_id)
        if outputs is None:
            if self.dead:
                raise EngineDeadError(f"no live request with id {request_id!r}: {self.dead}")
            raise RequestError(f"no live request with id {request_id!r} (finished and read, aborted, or never submitted)",
                               "request_id")
        if outputs.has_reader:  # a second reader would wait forever for outputs the first one takes
            raise RequestError(f"request {request_id!r} is already being read by another stream", "request_id")
        outputs.has_reader = True
        finished = False
        try:
            while True:
                out: RequestOutput = await outputs.get()
                finished = outputs.is_done
                yield out
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """End a request; its stream (if one is read) gets a final output with "abort". A
        request still waiting for its grammar is refused instead: its submit raises
        RequestAbortedError."""
        self._require_loop()
        outputs = self._live.get(request_id)
        if outputs is not None:
            outputs.abandon()  # forgotten once it ends, even if nobody reads its final output
        if not self._tasks:
            return
        if request_id in self._in_intake:  # behind its Submit, which intake may still hold (tokenizing, compiling)
            self.intake.inbox.put_nowait(AbortRequest(request_id))
        else:  # straight to the scheduler: not behind other requests' tokenizing
            self.scheduler.abort(request_id)

    # --- observation --------------------------------------------------------------------

    @property
    def queue_capacity(self) -> int:
        """Requests that may wait at once ([scheduler] max_waiting)."""
        return self.config.scheduler.max_waiting

    def _broadcast(self, record: StepRecord) -> None:
        self._subscribers.publish(record)  # a slow subscriber loses its oldest record, never blocks the engine

    async def steps(self) -> AsyncIterator[StepRecord]:
        """Every StepRecord from now on, until the engine stops or dies (`dead` says why); at
        once for an engine that already has."""
        self._require_loop()
        with self._subscribers.subscribe() as records:
            async for record in records:
                yield record

    def step_cost(self) -> CostFigures:
        """The step-cost model: coefficients, fit quality, last predicted vs actual step."""
        self._require_built()
        return self.scheduler.cost.figures()

    def snapshot(self) -> EngineSnapshot:
        """Queues as of the scheduler's last turn; KV figures, arrivals and grammar waits as of now."""
        self._require_built()
        kv = self.block_manager.figures
        return msgspec.structs.replace(
            self.scheduler.snapshot, kv_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            prefix_cache_hit_rate=kv.hit_rate, num_waiting_for_grammar=self.intake.num_compiling,
            num_arriving=self.scheduler.num_arriving,
        )

    def _require_loop(self) -> None:
        """An engine's actors, queues and futures belong to the loop it was started on."""
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            raise RuntimeError("this Engine was started on another event loop (an earlier asyncio.run?); it can "
                               "only be used from that one: create and start a new Engine on this loop "
                               "(Engine(config, loaded=...) reuses a loaded model)")

    def _require_built(self) -> None:
        if not hasattr(self, "scheduler"):  # the actors exist once start() has built them
            raise EngineDeadError("engine is not started")
