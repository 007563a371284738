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


class HungRecords:
    """A hung replica's steps stream: no record ever comes, and cancel() does not wake it."""

    async def __anext__(self):
        await asyncio.Event().wait()


@pytest.mark.parametrize("how", ["shutdown", "marked down"])
async def test_a_hung_replicas_step_stream_ends_at_shutdown_or_when_marked_down(how):
    """It waited for the hung replica until shutdown's own 5 s limit cancelled its handler."""
    from frontends.cluster.app import _until_gone
    from frontends.cluster.cluster_engine import ReplicaGone

    loop = asyncio.get_running_loop()
    ended, down = loop.create_future(), loop.create_future()
    reader = asyncio.create_task(anext(_until_gone(HungRecords(), ended, down), "ended"))
    await asyncio.sleep(0.05)
    assert not reader.done()
    if how == "shutdown":
        ended.set_result(None)
    else:
        down.set_exception(ReplicaGone("replica-0 is down"))
    assert await asyncio.wait_for(reader, 1) == "ended"


@pytest.mark.parametrize("ids", [[2**64 - 1] * 16, ["a"] * 16, [-1, 5]])
async def test_prompt_ids_the_model_lacks_are_refused_as_intake_refuses_them(ids):
    """The ingress hashed them first: OverflowError / TypeError (a 500) instead of the 400."""
    from engine.errors import RequestError

    engine, handles = cluster(ACCEPTED)
    with pytest.raises(RequestError, match=r"prompt token ids must be integers in \[0, ") as e:
        await engine.submit(ids, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt" and handles[0].calls == 0
