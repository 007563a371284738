"""/metrics: vLLM-named Prometheus metrics fed by StepRecords and the engine snapshot, in a
registry per app (two servers in one process keep separate counts)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.engine.util import greedy
from tests.frontends.conftest import get_metric, metric, serving, tiny_config

EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "stepwise:steps": "counter",
    "stepwise:step_tokens": "counter",
}


async def until(client, name: str, value: float, **labels) -> None:
    for _ in range(200):
        try:
            if await get_metric(client, name, **labels) == value:
                return
        except AssertionError:  # sample not there yet
            pass
        await asyncio.sleep(0.01)
    assert await get_metric(client, name, **labels) == value


async def test_metric_families(tiny):
    _, client = tiny
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    families = {f.name: f.type for f in text_string_to_metric_families(await resp.text())}
    for name, kind in EXPECTED.items():
        assert families.get(name) == kind, name


async def test_finish_reason_series_start_at_zero(tiny_model):
    """They appeared at their first increment, so rate() over them missed it (vLLM pre-creates them)."""
    async with serving(tiny_model, tiny_config()) as (_, client):
        text = await (await client.get("/metrics")).text()
    for reason in ("stop", "length", "abort", "error"):
        assert metric(text, "vllm:request_success_total", finished_reason=reason) == 0, reason


async def test_counts_follow_requests(tiny_model):
    async with serving(tiny_model, tiny_config(policy="chunked")) as (engine, client):
        resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
        assert (await resp.json())["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                                                  "prompt_tokens_details": {"cached_tokens": 0}}
        await until(client, "vllm:request_success_total", 1, finished_reason="length", model_name="tiny")
        text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:prompt_tokens_total") == 5
    assert metric(text, "vllm:generation_tokens_total") == 5
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 1
    assert metric(text, "vllm:inter_token_latency_seconds_count") == 4
    assert metric(text, "vllm:e2e_request_latency_seconds_count") == 1
    assert metric(text, "stepwise:steps_total", policy="chunked") == 5
    assert metric(text, "vllm:iteration_tokens_total_count") == 5
    assert metric(text, "vllm:iteration_tokens_total_sum") == 5 + 4
    assert metric(text, "stepwise:step_tokens_total", policy="chunked", kind="prefill") == 5
    assert metric(text, "stepwise:step_tokens_total", policy="chunked", kind="decode") == 4
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0


async def test_two_servers_in_one_process(tiny_model):
    async with serving(tiny_model, tiny_config()) as (_, a), serving(tiny_model, tiny_config(policy="continuous")) as (_, b):
        for _ in range(2):
            assert (await a.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})).status == 200
        assert (await b.post("/v1/completions", json={"prompt": "y", "max_tokens": 3, "ignore_eos": True})).status == 200
        await until(a, "vllm:generation_tokens_total", 4)
        await until(b, "vllm:generation_tokens_total", 3)
        assert await get_metric(b, "stepwise:steps_total", policy="continuous") == 3


async def test_prompt_tokens_count_at_prefill_and_request_histograms(tiny_model):
    prompt = "a prompt of two blocks: thirty-two tokens or more, here."
    async with serving(tiny_model, tiny_config()) as (engine, client):
        n = len(engine.tokenizer.encode(prompt, add_special_tokens=False))
        records = []

        async def watch():
            async for r in engine.steps():
                records.append(r)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 200, "ignore_eos": True})
        assert resp.status == 200
        await until(client, "vllm:prompt_tokens_total", n)
        watcher.cancel()
        # the step that prefilled it counted its prompt, long before the step it finished in
        counted = [i for i, r in enumerate(records) if r.num_prompt_tokens]
        ended = [i for i, r in enumerate(records) if r.finished]
        assert [records[i].num_prompt_tokens for i in counted] == [n] and counted[0] < ended[0]
        assert not records[counted[0]].finished
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert resp.status == 200
        await until(client, "vllm:request_prompt_tokens_count", 2)
        text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:prompt_tokens_total") == 2 * n
    assert metric(text, "vllm:prefix_cache_queries_total") == 2 * n
    assert metric(text, "vllm:prefix_cache_hits_total") == 16 * (n // 16) - (16 if n % 16 == 0 else 0)
    assert metric(text, "vllm:request_prompt_tokens_sum") == 2 * n
    assert metric(text, "vllm:request_generation_tokens_sum") == 202
    for name in ("queue", "prefill", "decode"):
        assert metric(text, f"vllm:request_{name}_time_seconds_count") == 2


async def test_requests_waiting_for_their_grammar_count_as_waiting(tiny_model, monkeypatch):
    """max_waiting counts them; the gauge did not (it showed 0 while they waited)."""
    import threading

    from engine import StructuredOutput
    from engine.structured.compiler import GrammarCache

    release = threading.Event()
    compile_for_real = GrammarCache._compile
    monkeypatch.setattr(GrammarCache, "_compile", lambda self, spec: release.wait(30) and compile_for_real(self, spec))
    schema = StructuredOutput.from_schema({"type": "boolean"}).json_schema
    body = {"prompt": "yes or no", "max_tokens": 8, "structured_outputs": {"json": schema}}
    async with asyncio.timeout(60), serving(tiny_model, tiny_config()) as (engine, client):
        answer = asyncio.create_task(client.post("/v1/completions", json=body))
        try:
            await until(client, "vllm:num_requests_waiting", 1)
        finally:
            release.set()
        assert (await answer).status == 200
        await until(client, "vllm:num_requests_waiting", 0)


async def test_requests_arriving_during_a_long_step_count_as_waiting(tiny_model):
    """The gauge read the scheduler's queue as of its last turn: during one long step it stayed
    frozen while requests arrived (the scheduler applies them at its next turn)."""
    import threading

    in_step, release = threading.Event(), threading.Event()

    def hold_first_step(plan) -> None:  # runs in the executor thread before each step
        if not in_step.is_set():
            in_step.set()
            release.wait(60)

    body = {"prompt": "Hello", "max_tokens": 2}
    async with asyncio.timeout(120), serving(tiny_model, tiny_config(), fault_hook=hold_first_step) as (engine, client):
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        try:
            assert await asyncio.to_thread(in_step.wait, 30)
            assert await get_metric(client, "vllm:num_requests_waiting") == 0
            more = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            await until(client, "vllm:num_requests_waiting", 2)
            assert await get_metric(client, "vllm:num_requests_running") == 1
        finally:
            release.set()
        assert [r.status for r in await asyncio.gather(first, *more)] == [200] * 3
        await until(client, "vllm:num_requests_waiting", 0)


async def test_ttft_e2e_and_queue_time_count_from_submit(tiny_model, monkeypatch):
    """They were measured from when intake had tokenized the prompt and compiled its grammar: a
    30,000-value enum's 7.7 s compile was 0.003 s of TTFT in /metrics (vLLM measures from arrival)."""
    import engine.intake

    delay, real = 0.4, engine.intake.prompt_ids

    async def slow_prompt_ids(*args, **kwargs):
        await asyncio.sleep(delay)  # stands in for a slow tokenization or grammar compile
        return await real(*args, **kwargs)

    monkeypatch.setattr(engine.intake, "prompt_ids", slow_prompt_ids)
    async with serving(tiny_model, tiny_config(policy="chunked")) as (_, client):
        resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
        assert resp.status == 200
        await asyncio.sleep(0.2)
        text = await (await client.get("/metrics")).text()
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert metric(text, f"vllm:{name}_sum") >= delay, name


async def test_prefix_cache_hits_leave_out_a_preempted_requests_own_blocks(tiny_model):
    """Prompts that share no block gave a 48 % hit rate under preemption: a victim finding its
    own blocks again was counted as a hit (vLLM counts those apart, unexported)."""
    cfg = tiny_config(policy="continuous", num_blocks=12, block_size=4, max_num_batched_tokens=64)
    async with serving(tiny_model, cfg) as (engine, client):
        async def one(i: int) -> dict:
            resp = await client.post("/v1/completions", json={"prompt": f"{i}abcdefg", "max_tokens": 26,
                                                                "ignore_eos": True})
            assert resp.status == 200
            return (await resp.json())["usage"]

        usages = await asyncio.gather(*[one(i) for i in range(3)])
        await asyncio.sleep(0.2)
        text = await (await client.get("/metrics")).text()
        rate = engine.snapshot().prefix_cache_hit_rate
    assert metric(text, "vllm:num_preemptions_total") > 0, "no preemption: the test proves nothing"
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) == 0
    assert metric(text, "vllm:prefix_cache_hits_total") == 0 and rate == 0
    assert metric(text, "vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    assert metric(text, "stepwise:step_tokens_total", policy="continuous", kind="cached") > 0  # compute saved


async def test_per_request_histograms_observe_what_happened(tiny_model):
    """n = 3 observed prompts of 0 tokens for choices 1 and 2; a request aborted while waiting
    observed a queue time, and prefill and decode times of 0 s."""
    async with serving(tiny_model, tiny_config(policy="chunked", max_num_seqs=3)) as (engine, client):
        resp = await client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2, "n": 3,
                                                            "ignore_eos": True})
        assert resp.status == 200
        await asyncio.sleep(0.2)
        text = await (await client.get("/metrics")).text()
        assert metric(text, "vllm:request_prompt_tokens_bucket", le="1.0") == 0
        assert metric(text, "vllm:request_prompt_tokens_count") == 3
        before = {n: metric(text, f"vllm:request_{n}_time_seconds_count") for n in ("queue", "prefill", "decode")}
        started = [asyncio.Event() for _ in range(3)]

        async def read(request_id: str, first: asyncio.Event) -> None:
            async for _ in engine.stream(request_id):
                first.set()

        running = [await engine.submit([5 + i] * 8, greedy(500)) for i in range(3)]
        readers = [asyncio.create_task(read(r, e)) for r, e in zip(running, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)  # each has its first token
        waiting = await engine.submit([9] * 8, greedy(5))  # max_num_seqs 3: it waits
        await asyncio.sleep(0.05)
        for request_id in (waiting, *running):
            await engine.abort(request_id)
        await asyncio.gather(*readers)
        await asyncio.sleep(0.3)
        text = await (await client.get("/metrics")).text()
    after = {n: metric(text, f"vllm:request_{n}_time_seconds_count") for n in ("queue", "prefill", "decode")}
    assert after == {n: before[n] + 3 for n in before}  # the waiting one reached no phase
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 4
