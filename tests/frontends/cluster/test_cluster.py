"""Two tiny-model engine replicas on a local Ray (2 CPUs) behind the ingress app: the OpenAI
SDK unchanged, SSE bytes equal to the single-process server's, prefix affinity and spread,
the API key, merged metrics and per-replica steps, and a replica killed mid-stream.

Ray starts once for the module (~15-45 s on a loaded 2-core machine) and is shut down at the
end, so no Ray process outlives these tests. Skipped when the `ray` extra is not installed."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from contextlib import asynccontextmanager

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")

import openai  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from engine.model.tiny import tiny_tokenizer  # noqa: E402
from frontends.cluster.app import REPLICA_HEADER, STEP_RELAY, create_cluster_app  # noqa: E402
from frontends.cluster.cluster_engine import ClusterEngine  # noqa: E402
from frontends.cluster.launch import Replicas  # noqa: E402
from monitor.http_source import HttpSource  # noqa: E402
from monitor.source import Backoff, Refused, follow  # noqa: E402
from tests.frontends.conftest import metric, serving, sse_events, tiny_config  # noqa: E402

# torch attention: a replica (and its restart) must not wait for the C++ kernel to compile
CONFIG = tiny_config(replicas=2, replica_cpus=0.5, ray_num_cpus=2, health_check_ms=200, attention_backend="torch")
NAMES = ["replica-0", "replica-1"]
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4  # ~16 blocks of 16 bytes
CREATED = 1700000000


@pytest.fixture(scope="module")
def replicas():
    started = Replicas.connect(CONFIG)
    replicas = Replicas.start(CONFIG, started)
    try:
        yield replicas
    finally:
        replicas.stop()
        if ray.is_initialized():
            ray.shutdown()


@asynccontextmanager
async def ingress(replicas: Replicas, config=CONFIG, **app_kwargs):
    engine = await ClusterEngine(config, replicas.handles, tiny_tokenizer(), replicas.max_model_len).start()
    client = TestClient(TestServer(create_cluster_app(engine, **app_kwargs)))
    await client.start_server()
    try:
        yield engine, client
    finally:
        await client.close()
        await engine.stop()


def fixed_ids():
    counter = itertools.count()
    return lambda prefix: f"{prefix}-{next(counter)}"


async def test_openai_sdk_streams_chat_and_completions(replicas):
    async with ingress(replicas) as (_, client):
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Say hi"}]
        whole = await sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        stream = await sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                   stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == whole.choices[0].message.content and whole.usage.completion_tokens == 8
        stream = await sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"
        await sdk.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
                              "max_completion_tokens": 5, "temperature": 0, "stream": True}),
    ("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2,
                         "stream": True, "stream_options": {"include_usage": True}}),  # n > 1 through the router
])
async def test_sse_bytes_equal_the_single_process_server(tiny_model, replicas, path, body):
    single_config = tiny_config(attention_backend="torch")
    async with serving(tiny_model, single_config, new_id=fixed_ids(), clock=lambda: CREATED) as (_, single):
        expected = await (await single.post(path, json=body)).read()
    async with ingress(replicas, new_id=fixed_ids(), clock=lambda: CREATED) as (_, client):
        resp = await client.post(path, json=body)
        got = await resp.read()
    assert resp.status == 200 and resp.headers[REPLICA_HEADER] in NAMES
    assert sse_events(got)[-1] == "[DONE]"
    assert got == expected


async def test_a_prompt_list_is_served_and_names_each_prompt_s_replica(tiny_model, replicas):
    body = {"model": "tiny", "prompt": ["Hello", "Bye bye", "Third one"], "max_tokens": 4, "temperature": 0, "n": 2}
    async with serving(tiny_model, tiny_config(attention_backend="torch"), new_id=fixed_ids(),
                       clock=lambda: CREATED) as (_, single):
        expected = await (await single.post("/v1/completions", json=body)).json()
    async with ingress(replicas, new_id=fixed_ids(), clock=lambda: CREATED) as (_, client):
        resp = await client.post("/v1/completions", json=body)
        got = await resp.json()
    assert resp.status == 200 and got == expected and len(got["choices"]) == 6
    assert all(name in NAMES for name in resp.headers[REPLICA_HEADER].split(",")), resp.headers[REPLICA_HEADER]
    assert len(resp.headers[REPLICA_HEADER].split(",")) == 3


async def test_a_batch_refused_at_a_later_prompt_lets_the_earlier_ones_go(replicas):
    """Prompt 0 is accepted on a replica, prompt 1 refused (empty): the 400 lets prompt 0 go, its
    router slot too (it used to stay in flight for good, and routing avoided that replica)."""
    async with ingress(replicas) as (engine, client):
        for body in ({"prompt": ["Hi", ""]}, {"prompt": [[1, 2], [5] * 9000]}):
            resp = await client.post("/v1/completions", json={"model": "tiny", "max_tokens": 4, **body})
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
            assert not engine._remotes and set(engine.router.load.values()) == {0}, engine.router.load


async def test_shared_prefix_sticks_to_one_replica_and_distinct_prompts_spread(replicas):
    async with ingress(replicas) as (_, client):
        async def chat(system: str, user: str) -> str:
            resp = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": 3})
            assert resp.status == 200, await resp.text()
            return resp.headers[REPLICA_HEADER]

        first = await chat(SYSTEM, "question 0")
        cached_before = metric(await (await client.get("/metrics")).text(), "stepwise:step_tokens_total",
                               kind="cached", replica=first)
        together = await asyncio.gather(*(chat(SYSTEM, f"question {i}") for i in range(1, 7)))
        assert set(together) == {first}
        cached_after = metric(await (await client.get("/metrics")).text(), "stepwise:step_tokens_total",
                              kind="cached", replica=first)
        assert cached_after - cached_before >= 6 * 16 * 10  # each reused most of the system prompt's blocks
        distinct = [await chat(f"{i} is the system prompt of conversation number {i}. " * 3, "hi") for i in range(4)]
        assert set(distinct) == set(NAMES)


async def test_a_shared_opening_block_alone_does_not_pin_prompts_to_one_replica(replicas):
    """Every chat shares its template's opening block: followed, it sent all of them to one replica."""
    async with ingress(replicas) as (_, client):
        served = []
        for i in range(4):  # one 16-token block in common, 2.3 blocks each
            resp = await client.post("/v1/completions", json={"prompt": "A" * 16 + f"{i:04d} is question number!",
                                                              "max_tokens": 2})
            assert resp.status == 200
            served.append(resp.headers[REPLICA_HEADER])
        assert set(served) == set(NAMES), served


async def test_api_key_is_enforced_on_the_ingress(replicas):
    async with ingress(replicas, CONFIG.with_overrides(api_key="sk-cluster")) as (_, client):
        body = {"prompt": "Hello", "max_tokens": 2}
        refused = await client.post("/v1/completions", json=body)
        assert refused.status == 401 and (await refused.json())["error"]["code"] == "invalid_api_key"
        wrong = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-other"})
        assert wrong.status == 401
        ok = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-cluster"})
        assert ok.status == 200 and ok.headers[REPLICA_HEADER] in NAMES
        assert (await client.get("/health")).status == 200  # unprotected by default, as engine-serve


async def test_metrics_state_and_steps_per_replica(replicas):
    async with ingress(replicas) as (_, client):
        steps = {name: await client.get(f"/v1/engine/steps?replica={name}") for name in NAMES}
        twice = await client.get(f"/v1/engine/steps?replica={NAMES[0]}")
        assert client.app[STEP_RELAY].streams() == len(NAMES)  # watchers of a replica share one Ray stream
        served = set()
        for i in range(4):  # distinct prompts reach both replicas
            resp = await client.post("/v1/completions", json={"prompt": f"prompt {i} " * 3, "max_tokens": 2})
            served.add(resp.headers[REPLICA_HEADER])
        assert served == set(NAMES)
        for name, resp in steps.items():
            assert resp.status == 200 and resp.headers[REPLICA_HEADER] == name
            record = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 60)
            assert record.startswith(b"data: {") and b'"policy":"chunked"' in record
            resp.close()
        assert (await asyncio.wait_for(twice.content.readuntil(b"\n\n"), 60)).startswith(b"data: {")
        twice.close()
        text = await (await client.get("/metrics")).text()
        for name in NAMES:
            assert metric(text, "vllm:generation_tokens_total", replica=name) >= 2
            assert metric(text, "stepwise:replica_up", replica=name) == 1
        state = await (await client.get("/v1/engine/state?replica=replica-1")).json()
        assert state["replica"] == "replica-1" and state["snapshot"]["policy"] == "chunked"
        assert [r["name"] for r in state["replicas"]] == NAMES
        unknown = await client.get("/v1/engine/steps?replica=replica-9")
        assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "unknown_replica"
        monitor = HttpSource(str(client.make_url("")), replica="replica-1")  # engine-monitor --url ... --replica
        await monitor.connect()
        seen = await monitor.state()
        assert seen.replica == "replica-1" and [r.name for r in seen.replicas] == NAMES
        await monitor.close()
        bogus = HttpSource(str(client.make_url("")), replica="replica-9")  # the monitor stops retrying
        events = [ev async for ev in follow(bogus, backoff=Backoff(0.05))]
        await bogus.close()
        assert isinstance(events[-1], Refused) and "replicas: replica-0, replica-1" in events[-1].reason


async def test_replica_killed_mid_stream_ends_its_stream_and_comes_back(replicas):
    async with ingress(replicas) as (engine, client):
        resp = await client.post("/v1/completions", json={
            "prompt": "Tell a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True})
        victim = resp.headers[REPLICA_HEADER]
        await resp.content.readuntil(b"\n\n")  # the first token is out: the stream is live
        old_pid = (await replicas.handles[victim].describe.remote())["pid"]
        os.kill(old_pid, signal.SIGKILL)
        events = sse_events(await resp.read())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error" and victim in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2])  # tokens streamed before the kill

        for i in range(10):  # the survivor serves everything meanwhile
            ok = await client.post("/v1/completions", json={"prompt": f"after the crash {i}", "max_tokens": 3})
            assert ok.status == 200, await ok.text()
            assert ok.headers[REPLICA_HEADER] != victim

        await asyncio.wait_for(engine.wait_healthy(victim), 240)  # Ray restarted it, the probe saw it
        assert (await replicas.handles[victim].describe.remote())["pid"] != old_pid
        served = set()
        for i in range(4):
            again = await client.post("/v1/completions", json={"prompt": f"back again {i} " * 2, "max_tokens": 2})
            assert again.status == 200
            served.add(again.headers[REPLICA_HEADER])
        assert victim in served


async def test_a_hung_replica_is_routed_around_and_its_streams_end(replicas):
    """A request routed to a replica that hangs waited for it, and so did its streams and an
    abort of them (minutes: until Ray's health check killed it), holding a shutdown."""
    async with ingress(replicas) as (engine, client):
        story = {"prompt": SYSTEM + "Tell a long story", "max_tokens": 1500, "ignore_eos": True}
        aborted = await client.post("/v1/completions", json={**story, "stream": True})
        left = await client.post("/v1/completions", json={**story, "stream": True})  # the prefix: same replica
        victim = aborted.headers[REPLICA_HEADER]
        assert left.headers[REPLICA_HEADER] == victim
        for resp in (aborted, left):
            await resp.content.readuntil(b"\n\n")
        pid = (await replicas.handles[victim].describe.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await engine.abort(aborted.headers["X-Request-Id"])  # before the probe notices: 2 s to take it
            events = sse_events(await asyncio.wait_for(aborted.read(), 30))
            assert events[-1] == "[DONE]" and victim in events[-2]["error"]["message"], events[-2:]
            assert loop.time() - start < 15  # the 2 s abort timeout, on a loaded machine
            start = loop.time()  # the same prompt follows its prefix to the victim, then fails over
            moved = await client.post("/v1/completions", json={**story, "max_tokens": 2})
            assert moved.status == 200 and moved.headers[REPLICA_HEADER] != victim
            assert loop.time() - start < 30  # the probe's 5 s timeout, on a loaded machine
            events = sse_events(await asyncio.wait_for(left.read(), 30))  # ended: its replica is down
            assert events[-1] == "[DONE]" and victim in events[-2]["error"]["message"], events[-2:]
            steps = await client.get(f"/v1/engine/steps?replica={victim}")  # a 503, not a stream that never starts
            assert steps.status == 503 and (await steps.json())["error"]["code"] == "replica_unavailable"
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(engine.wait_healthy(victim), 120)


def test_replica_config_fixes_the_thread_count():
    from frontends.cluster.launch import replica_config

    assert replica_config(CONFIG.with_overrides(replica_cpus=2.5))["model"]["num_threads"] == 2
    assert replica_config(CONFIG.with_overrides(replica_cpus=0.5))["model"]["num_threads"] == 1
    assert replica_config(CONFIG.with_overrides(replica_cpus=0.5, num_threads=3))["model"]["num_threads"] == 3
    assert replica_config(CONFIG)["cluster"] == CONFIG.to_dict()["cluster"]
