"""ClusterEngine: the engine API the aiohttp frontend calls, answered by engine replicas.

It has what the frontend uses of `Engine` — `submit` / `stream` / `generate` / `abort`,
`ready` / `dead`, `config`, `tokenizer`, `max_model_len`, `queue_capacity`, `steps` — so the
OpenAI routes, their SSE bytes, errors and the shutdown drain are the single-process server's own code.

`submit` tokenizes the prompt (once), hashes its full KV blocks with the block manager's
chain, asks the `Router` for a replica, and opens the replica's `generate` stream; the
replica's first item says whether its engine accepted the request (a refusal raises the same
engine error here). A replica that cannot be reached — the call fails, or the health task
marks it down (dead, or hung) before it answers — is given up and the next one is tried, as
is the next one when a replica's waiting queue is full (a prefix-routed prompt would
otherwise be refused while another replica idles). `stream` relays the replica's outputs; if
the replica dies or is marked down (a hung one: no answer to the health probe for 5 s)
mid-stream, or cannot be told to abort within ABORT_TIMEOUT_S (shutdown must not wait for
it), the stream ends with a final output `finish_reason="error"` (the frontend turns it into
an SSE error event and [DONE]). A health task probes every replica and marks it up when it
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import EngineConfig, RequestOutput, SamplingParams, StepRecord
from engine.admission import check_prompt_ids
from engine.block_hash import prefix_block_hashes, salted_root
from engine.chat_prompt import prompt_ids
from engine.errors import ContextLengthError, EngineDeadError, QueueFullError, RequestAbortedError, RequestError
from frontends.cluster.replica import ACCEPTED, Refusal
from frontends.cluster.router import Router

ERRORS = {cls.__name__: cls for cls in (RequestError, ContextLengthError, QueueFullError, EngineDeadError,
                                        RequestAbortedError)}
MAX_REMEMBERED = 4096  # request id -> replica, for the response header (written after the stream ends)
ABORT_TIMEOUT_S = 2.0  # a replica that does not take an abort this soon: its stream is ended here


class ReplicaGone(Exception):
    """The replica was marked down, or did not take an abort, while a call to it was pending."""


@dataclass
class _Remote:
    replica: str
    outputs: object  # ray.serve.handle.DeploymentResponseGenerator
    num_choices: int  # n: the stream ends with the last choice's final output
    cut: asyncio.Future  # resolved when the replica could not be told to abort: stop waiting for it
    read: bool = False  # stream() has taken it: its end releases the router slot


def _refusal_error(refusal: Refusal) -> Exception:
    cls = ERRORS.get(refusal.kind, RuntimeError)
    return cls(refusal.message, refusal.param) if issubclass(cls, RequestError) else cls(refusal.message)


class ClusterEngine:
    def __init__(self, config: EngineConfig, handles: dict, tokenizer, max_model_len: int):
        cluster = config.cluster
        self.config = config
        self.handles = handles  # replica name -> DeploymentHandle
        self._streaming = {name: handle.options(stream=True) for name, handle in handles.items()}
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_name = config.served_model_name
        self.router = Router.for_cluster(list(handles), cluster)
        self.dead: str | None = None
        self._remotes: dict[str, _Remote] = {}
        self._served_by: OrderedDict[str, str] = OrderedDict()
        self._stopped = asyncio.Event()
        self._health: asyncio.Task | None = None
        self._health_changed = asyncio.Event()  # set (and replaced) when a replica comes back
        self._down: dict[str, asyncio.Future] = {}  # replica -> resolved when it is marked down
        self._aborts: set[asyncio.Task] = set()

    @property
    def queue_capacity(self) -> int:
        """Requests that may wait at once: every replica's max_waiting."""
        return self.config.scheduler.max_waiting * len(self.handles)

    # not ready once started means every replica is marked down (hung, dead or restarting)
    unready = ("unavailable", "replicas_unavailable", "no engine replica is up (each is down or restarting); "
               "retry shortly")

    @property
    def ready(self) -> bool:
        return not self.dead and bool(self.router.healthy)

    async def start(self) -> ClusterEngine:
        self._health = asyncio.create_task(self._check_health(), name="stepwise-cluster-health")
        return self

    async def stop(self) -> None:
        self.dead = self.dead or "cluster stopped"
        self._stopped.set()
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health

    # --- requests ---------------------------------------------------------------------------

    async def submit(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
                     messages: list[dict] | None = None, request_id: str | None = None) -> str:
        if self.dead:
            raise EngineDeadError(self.dead)
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        ids = await prompt_ids(self.tokenizer, prompt, messages)
        check_prompt_ids(ids, len(self.tokenizer))  # before hashing them (an id past 2^63 cannot be)
        hashes = list(prefix_block_hashes(ids, self.config.cache.block_size, root=salted_root(params.cache_salt)))
        full: dict[str, Exception] = {}  # replicas whose waiting queue refused it: the others may have room
        for _ in range(len(self.handles)):
            name = self.router.route(hashes, len(ids) / self.config.cache.block_size, frozenset(full))
            if name is None:
                break
            outputs = self._streaming[name].generate.remote(ids, params, request_id)
            try:
                verdict = await unless(outputs.__anext__(), self.went_down(name))
            except asyncio.CancelledError:
                outputs.cancel()
                self.router.release(name)
                raise
            except Exception as e:  # the replica is unreachable, died or hangs: try another one
                outputs.cancel()
                self.router.release(name)
                self._mark_down(name, e)
                continue
            if verdict != ACCEPTED:
                outputs.cancel()
                self.router.release(name)
                refused = _refusal_error(verdict)
                if isinstance(refused, QueueFullError):
                    full[name] = refused
                    continue
                if isinstance(refused, EngineDeadError):  # its engine died: the probe decides when it is back
                    self._mark_down(name, refused)
                    continue
                raise refused
            self._remotes[request_id] = _Remote(name, outputs, params.n, asyncio.get_running_loop().create_future())
            self._remember(request_id, name)
            return request_id
        if full:
            raise next(iter(full.values()))
        raise EngineDeadError("no engine replica is available")

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        remote = self._remotes[request_id]
        remote.read = True
        finished, ended = False, set()
        try:
            try:
                while True:
                    try:
                        gone = (remote.cut, self.went_down(remote.replica))  # stop waiting on a hung replica
                        out = await unless(remote.outputs.__anext__(), *gone)
                    except StopAsyncIteration:
                        break
                    if out.finished:
                        ended.add(out.index)
                    finished = len(ended) >= remote.num_choices
                    yield out
                    if finished:
                        return
                error = "the replica ended the stream without a final output"
            except Exception as e:  # the replica died (or Ray lost it, or it hangs) mid-stream
                remote.outputs.cancel()
                if not isinstance(e, ReplicaGone):  # marked down already, or one abort was slow: the probe decides
                    self._mark_down(remote.replica, e)
                error = f"engine replica {remote.replica} failed: {type(e).__name__}"
            finished = True
            yield RequestOutput(request_id=request_id, text="", token_ids=[], finished=True, finish_reason="error",
                                error=error)
        finally:
            del self._remotes[request_id]
            self.router.release(remote.replica)
            if not finished:
                remote.outputs.cancel()  # cancels the replica's generate, which aborts the request

    async def generate(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
                       messages: list[dict] | None = None, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        request_id = await self.submit(prompt, params, messages=messages, request_id=request_id)
        async for out in self.stream(request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        """Abort on the replica: its engine ends the stream with a final "abort" output. A
        request whose stream nobody reads (a batch refused at a later prompt) is let go here:
        its router slot is released and its generate cancelled, which aborts it on the replica."""
        remote = self._remotes.get(request_id)
        if remote is None:
            return
        if not remote.read:
            del self._remotes[request_id]
            self.router.release(remote.replica)
            remote.outputs.cancel()
        task = asyncio.create_task(self._abort_on_replica(remote, request_id))  # never waits for a hung one
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_on_replica(self, remote: _Remote, request_id: str) -> None:
        try:
            await asyncio.wait_for(self.handles[remote.replica].abort.remote(request_id), ABORT_TIMEOUT_S)
        except Exception as e:  # down or hung: its stream would wait for it (a shutdown for minutes)
            if not remote.cut.done():
                remote.cut.set_exception(ReplicaGone(f"engine replica {remote.replica} did not take the abort: "
                                                     f"{type(e).__name__}"))
                remote.cut.exception()  # retrieved: a stream that already ended never reads it

    def replica_of(self, request_id: str) -> str | None:
        """The replica that served `request_id` (for the x-stepwise-replica header)."""
        return self._served_by.get(request_id)

    def _remember(self, request_id: str, name: str) -> None:
        self._served_by[request_id] = name
        while len(self._served_by) > MAX_REMEMBERED:
            self._served_by.popitem(last=False)

    # --- observation and health ---------------------------------------------------------------

    async def steps(self) -> AsyncIterator[StepRecord]:
        """The ingress has no steps of its own (each replica streams its own): none until stop."""
        await self._stopped.wait()
        return
        yield  # an async generator

    def _mark_down(self, name: str, why: BaseException | str) -> None:
        if name in self.router.healthy:
            print(f"[stepwise] {name} unreachable ({why!r}); routing around it", file=sys.stderr)
        self.router.mark_down(name)
        down = self.went_down(name)
        if not down.done():
            down.set_exception(ReplicaGone(f"engine replica {name} is down: {why!r}"))
            down.exception()  # retrieved: nobody may be waiting

    def went_down(self, name: str) -> asyncio.Future:
        """Resolved (with ReplicaGone) once `name` is marked down; a fresh one after it comes back."""
        if name not in self._down or (self._down[name].done() and name in self.router.healthy):
            self._down[name] = asyncio.get_running_loop().create_future()
        return self._down[name]

    async def _check_health(self) -> None:
        """Each replica on its own beat: a hung one's 5 s timeout used to slow every probe."""
        period = self.config.cluster.health_check_ms / 1000

        async def beat(name: str) -> None:
            while True:
                await self._probe(name)
                await asyncio.sleep(period)

        await asyncio.gather(*map(beat, self.handles))

    async def _probe(self, name: str) -> None:
        timeout = max(5.0, 5 * self.config.cluster.health_check_ms / 1000)
        try:
            await asyncio.wait_for(self.handles[name].check_health.remote(), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._mark_down(name, e)
            return
        if name not in self.router.healthy:
            print(f"[stepwise] {name} is healthy again", file=sys.stderr)
            self.router.mark_up(name)
            self._health_changed.set()
            self._health_changed = asyncio.Event()

    async def wait_healthy(self, name: str) -> None:
        """Until the router sends `name` requests again."""
        while name not in self.router.healthy:
            await self._health_changed.wait()


async def unless(call, *gone: asyncio.Future):
    """Await `call`, unless one of `gone` resolves first (its ReplicaGone is raised, `call` cancelled)."""
    item = asyncio.ensure_future(call)
    try:
        await asyncio.wait([item, *gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not item.done():  # gone first, or we were cancelled: nobody will read it
            item.cancel()
            item.add_done_callback(lambda t: t.cancelled() or t.exception())  # may end in Ray's own error
    if item.done() and not item.cancelled():
        return item.result()
    return next(g for g in gone if g.done()).result()  # raises ReplicaGone
