"""ClusterEngine.submit against stand-in replica handles (no Ray): a replica whose waiting queue
is full passes the request on to another, and a cluster with every replica down says so."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.errors import QueueFullError
from engine.model.tiny import tiny_tokenizer
from frontends.cluster.cluster_engine import ClusterEngine
from frontends.cluster.replica import ACCEPTED, Refusal
from frontends.http.errors import unready
from tests.frontends.conftest import tiny_config

FULL = Refusal("QueueFullError", "waiting queue is full (2 requests); retry later")


class Outputs:
    """A replica's generate stream: its verdict, then nothing."""

    def __init__(self, verdict):
        self.verdict = verdict

    async def __anext__(self):
        return self.verdict

    def cancel(self) -> None:
        pass


class Handle:
    def __init__(self, verdict):
        self.verdict, self.calls = verdict, 0

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, ids, params, request_id):
        self.calls += 1
        return Outputs(self.verdict)


def cluster(*verdicts, router: str = "prefix") -> tuple[ClusterEngine, list[Handle]]:
    handles = [Handle(v) for v in verdicts]
    config = tiny_config(replicas=len(handles), router=router)
    return ClusterEngine(config, {f"replica-{i}": h for i, h in enumerate(handles)}, tiny_tokenizer(), 2048), handles


@pytest.mark.parametrize("router", ["prefix", "round-robin", "least-loaded"])
async def test_a_full_replica_passes_the_request_to_another(router):
    """Prefix affinity sent a shared-prefix request to its full replica: 503 queue_full while the
    other replica idled (a prompt list could never pass, however often retried)."""
    engine, (full, free) = cluster(FULL, ACCEPTED, router=router)
    engine.router.route([], 0)  # replica-1 busier, so that every router tries replica-0 first
    engine.router.route([], 0)
    engine.router.release("replica-0")
    request_id = await engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert engine._remotes[request_id].replica == "replica-1" and full.calls == 1 and free.calls == 1
    assert engine.router.load == {"replica-0": 0, "replica-1": 2}  # the refusal released its slot


async def test_every_replica_full_is_queue_full():
    engine, handles = cluster(FULL, FULL)
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        await engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert [h.calls for h in handles] == [1, 1] and set(engine.router.load.values()) == {0}


async def test_every_replica_down_is_not_called_loading():
    """/health said "loading" and requests "the model is still loading" for hung replicas."""
    engine, _ = cluster(ACCEPTED, ACCEPTED)
    assert engine.ready
    for name in list(engine.handles):
        engine.router.mark_down(name)
    status, code, message = unready(engine)
    assert not engine.ready and status == "unavailable" and code == "replicas_unavailable"
    assert "no engine replica is up" in message


class Records:
    """A replica's steps stream: the records put on `queue`; a hung one never has any, and
    cancel() does not wake it."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    async def __anext__(self):
        item = await self.queue.get()
        if item is StopAsyncIteration:  # the replica ended the stream
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.cancelled = True


class StepsHandle:
    def __init__(self):
        self.streams: list[Records] = []

    def options(self, stream: bool):
        return self

    @property
    def steps(self):
        return self

    def remote(self):
        self.streams.append(Records())
        return self.streams[-1]


def relay_over(num_replicas: int):
    from frontends.cluster.step_relay import StepRelay

    handles = {f"replica-{i}": StepsHandle() for i in range(num_replicas)}
    engine = ClusterEngine(tiny_config(replicas=num_replicas), handles, tiny_tokenizer(), 2048)
    return engine, handles, StepRelay(engine)


async def test_watchers_of_a_replica_share_one_step_stream():
    """Each /v1/engine/steps client held its own streaming call, one of the replica's
    max_ongoing_requests slots: 65 watchers starved the health probe and the replica, marked
    down, had its generations cut."""
    _, handles, relay = relay_over(2)
    with relay.subscribe("replica-0") as a, relay.subscribe("replica-0") as b, relay.subscribe("replica-1") as c:
        await asyncio.sleep(0)  # the readers start
        assert [len(h.streams) for h in handles.values()] == [1, 1] and relay.streams() == 2
        handles["replica-0"].streams[0].queue.put_nowait("r0")
        handles["replica-1"].streams[0].queue.put_nowait("r1")
        assert [await anext(a), await anext(b), await anext(c)] == ["r0", "r0", "r1"]
        with relay.subscribe("replica-0"):  # a watcher leaving early keeps the stream for the rest
            pass
        assert not handles["replica-0"].streams[0].cancelled
    await asyncio.sleep(0)
    assert relay.streams() == 0 and all(h.streams[0].cancelled for h in handles.values())  # the last one left
    with relay.subscribe("replica-0"):
        await asyncio.sleep(0)
        assert len(handles["replica-0"].streams) == 2  # a fresh stream for the next watcher


@pytest.mark.parametrize("how", ["shutdown", "marked down", "stream ended"])
async def test_a_replicas_step_stream_ends_at_shutdown_when_marked_down_or_ended(how):
    """A hung replica's stream waited until shutdown's own 5 s limit cancelled its handler."""
    engine, handles, relay = relay_over(1)
    with relay.subscribe("replica-0") as records:
        reader = asyncio.create_task(anext(records, "ended"))
        await asyncio.sleep(0.05)
        assert not reader.done()
        if how == "shutdown":
            relay.close()
        elif how == "marked down":
            engine._mark_down("replica-0", "probe timed out")
        else:
            handles["replica-0"].streams[0].queue.put_nowait(StopAsyncIteration)
        assert await asyncio.wait_for(reader, 1) == "ended"
    await asyncio.sleep(0)
    assert relay.streams() == 0 and handles["replica-0"].streams[0].cancelled


class DeadOutputs:
    async def __anext__(self):
        raise RuntimeError("ActorDiedError (stand-in)")  # what a dead replica's generate raises

    def cancel(self) -> None:
        pass


async def test_every_replica_failing_while_a_request_is_placed_is_replicas_unavailable():
    """Both replicas died before the probe noticed: the first request, which found out, got the
    503 a single server gives a dead engine (engine_unavailable, no Retry-After); the next one
    the documented replicas_unavailable with Retry-After."""
    from aiohttp.test_utils import TestClient, TestServer

    from frontends.cluster.app import create_cluster_app

    engine, handles = cluster(ACCEPTED, ACCEPTED)
    for h in handles:
        h.remote = lambda *args: DeadOutputs()
    async with TestClient(TestServer(create_cluster_app(engine))) as client:
        for _ in range(2):
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
            body = await resp.json()
            assert resp.status == 503 and body["error"]["code"] == "replicas_unavailable", body
            assert resp.headers.get("Retry-After") == "1"


async def test_a_replica_whose_engine_died_is_routed_around():
    """Its EngineDeadError refusal was raised as it came (engine_unavailable), and then, with
    the review's first fix, read as "no engine replica is up" while the other replica was up."""
    dead = Refusal("EngineDeadError", "scheduler crashed: boom")
    engine, handles = cluster(dead, ACCEPTED, router="round-robin")
    request_id = await engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert engine._remotes[request_id].replica == "replica-1" and [h.calls for h in handles] == [1, 1]
    assert engine.router.healthy == {"replica-1"}  # the probe brings it back once it answers


async def test_a_step_stream_that_cannot_open_ends_its_watchers():
    """Ray's remote() raising left the feed open for ever: every watcher of that replica hung."""
    engine, handles, relay = relay_over(1)

    def refuse():
        raise RuntimeError("cannot open a stream")

    handles["replica-0"].remote = refuse
    with relay.subscribe("replica-0") as records:
        assert await asyncio.wait_for(anext(records, "ended"), 1) == "ended"
    assert relay.streams() == 0


@pytest.mark.parametrize("ids", [[2**64 - 1] * 16, ["a"] * 16, [-1, 5]])
async def test_prompt_ids_the_model_lacks_are_refused_as_intake_refuses_them(ids):
    """The ingress hashed them first: OverflowError / TypeError (a 500) instead of the 400."""
    from engine.errors import RequestError

    engine, handles = cluster(ACCEPTED)
    with pytest.raises(RequestError, match=r"prompt token ids must be integers in \[0, ") as e:
        await engine.submit(ids, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt" and handles[0].calls == 0
