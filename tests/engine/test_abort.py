"""Aborts: consumers that are cancelled or walk away mid-stream free their requests and KV,
the others are unaffected; engine.abort ends a running request with finish_reason "abort"."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import Engine
from engine.errors import RequestError
from tests.engine.util import POLICIES, Result, StepRecorder, assert_drained, greedy, run_request, tiny_config

N = 100


@pytest.mark.parametrize("policy", ["chunked", "continuous"])
async def test_cancelled_and_abandoned_consumers_free_everything(tiny_model, policy):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(4, 40))] for _ in range(N)]
    max_tokens = [rng.randint(8, 30) for _ in range(N)]
    cancel = {i for i in range(N) if i % 10 == 0}  # task.cancel() mid-stream
    walk_away = {i for i in range(N) if i % 10 == 5}  # break out of the loop
    cfg = tiny_config(policy=policy, max_num_seqs=32, num_blocks=512, block_size=8)
    async with Engine(cfg, loaded=tiny_model) as engine:
        recorder = await StepRecorder(engine).start()
        results = [Result("") for _ in range(N)]
        streaming = {i: asyncio.Event() for i in cancel}

        async def consume(i: int) -> None:
            async for out in engine.generate(prompts[i], greedy(max_tokens[i])):
                results[i].request_id = out.request_id
                results[i].outputs.append(out)
                if i in streaming and len(results[i].outputs) >= 2:
                    streaming[i].set()
                if i in walk_away and len(results[i].outputs) >= 3:
                    break

        async with asyncio.timeout(60):
            tasks = [asyncio.create_task(consume(i)) for i in range(N)]
            for i in sorted(cancel):
                await streaming[i].wait()
                tasks[i].cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
        for i in range(N):
            r = results[i]
            if i in cancel:
                assert isinstance(done[i], asyncio.CancelledError), (i, done[i])
                assert len(r.outputs) >= 2 and not r.outputs[-1].finished
            elif i in walk_away:
                assert done[i] is None and len(r.outputs) == 3 and not r.outputs[-1].finished
            else:
                assert done[i] is None, (i, done[i])
                assert r.finish_reason == "length" and len(r.token_ids) == max_tokens[i], i
                assert r.final.num_generated_tokens == max_tokens[i]
        # the cancelled / abandoned requests were aborted: nothing left running, waiting or held
        await assert_drained(engine, timeout=20)
        assert not engine._live
        assert not engine.scheduler.requests
        # one more request, so the step records also report the requests aborted last
        assert (await run_request(engine, [3, 4], greedy(2))).finish_reason == "length"
        records = await recorder.caught_up()
        reasons = {f.request_id: f.finish_reason for rec in records for f in rec.finished}
        for i in range(N):
            expected = "abort" if i in cancel | walk_away else "length"
            assert reasons[results[i].request_id] == expected, (i, reasons[results[i].request_id])
        recorder.stop()


@pytest.mark.parametrize("policy", POLICIES)
async def test_engine_abort_of_a_running_request(tiny_model, policy):
    async with asyncio.timeout(30):
        async with Engine(tiny_config(policy=policy), loaded=tiny_model) as engine:
            other = asyncio.create_task(run_request(engine, [9, 8, 7, 6], greedy(40)))
            request_id = await engine.submit([3, 4, 5, 6, 7], greedy(1000))
            outputs = []
            async for out in engine.stream(request_id):
                outputs.append(out)
                if len(outputs) == 2:
                    await engine.abort(request_id)
            final = outputs[-1]
            assert final.finished and final.finish_reason == "abort" and final.error is None
            assert 2 <= final.num_generated_tokens < 1000
            assert sum(len(o.token_ids) for o in outputs) == final.num_generated_tokens
            r = await other
            assert r.finish_reason == "length" and len(r.token_ids) == 40  # a static batch partner is unaffected
            await assert_drained(engine)


async def test_abort_of_a_waiting_request_and_of_an_unknown_id(tiny_model):
    cfg = tiny_config(policy="continuous", max_num_seqs=1)
    async with asyncio.timeout(30):
        async with Engine(cfg, loaded=tiny_model) as engine:
            running = asyncio.create_task(run_request(engine, [3, 4, 5], greedy(30)))
            await asyncio.sleep(0)
            waiting_id = await engine.submit([6, 7, 8], greedy(30))  # max_num_seqs=1: it waits
            await engine.abort(waiting_id)
            outs = [o async for o in engine.stream(waiting_id)]
            assert outs[-1].finish_reason == "abort" and outs[-1].num_generated_tokens == 0
            await engine.abort("no-such-request")
            r = await running
            assert r.finish_reason == "length" and len(r.token_ids) == 30
            await assert_drained(engine)


async def test_cancelled_submit_aborts_the_accepted_request(tiny_model):
    """A caller cancelled while intake is still working must not leave an unread request running."""
    async with Engine(tiny_config(policy="chunked"), loaded=tiny_model) as engine:
        recorder = await StepRecorder(engine).start()
        task = asyncio.create_task(engine.submit(list(range(3, 200)), greedy(200), request_id="gave-up"))
        await asyncio.sleep(0)  # intake has the Submit; the reply is not back yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_drained(engine)
        assert not engine.scheduler.requests
        steps_with_it = [r for r in await recorder.caught_up() if any(i.request_id == "gave-up" for i in r.items)]
        assert len(steps_with_it) < 10, "the abandoned request kept running towards its 200 tokens"


@pytest.mark.parametrize("held", ["compiling", "tokenizing"])
async def test_a_retry_under_a_cancelled_submits_id_is_refused_until_it_is_over(tiny_model, held):
    """The id was released at the cancel while intake still held the request, whose abort went
    out once intake accepted it: a retry under the same id was ended by it ("abort" after 41-113
    of 300 tokens), or failed as "already in use" after its submit had succeeded."""
    from engine import SamplingParams, StructuredOutput

    slow = StructuredOutput.from_schema({"enum": [f"value-{i:05d}-" + "x" * 20 for i in range(1500)]})
    prompt, params = (([5, 6, 7], SamplingParams(max_tokens=8, structured_output=slow)) if held == "compiling"
                      else ("ab" * 1020, SamplingParams(max_tokens=4)))  # long text: tokenized on intake's thread
    async with Engine(tiny_config(num_threads=1, calibrate_step_cost=False), loaded=tiny_model) as engine:
        first = asyncio.create_task(engine.submit(prompt, params, request_id="job"))
        for _ in range(3):
            await asyncio.sleep(0)  # intake holds it
        assert not first.done()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(RequestError, match="'job' is already in use"):
            await engine.submit([5, 6, 7], greedy(300), request_id="job")
        async with asyncio.timeout(10):
            while "job" in engine._live:  # until intake is done with the old request and its abort is in
                await asyncio.sleep(0.01)
        await assert_drained(engine)
        retry = await run_request(engine, [5, 6, 7], greedy(300), request_id="job")
        assert retry.finish_reason == "length" and len(retry.token_ids) == 300


async def test_abort_of_unknown_or_finished_ids_leaves_nothing_behind(tiny_model):
    async with Engine(tiny_config(policy="continuous"), loaded=tiny_model) as engine:
        result = await run_request(engine, [5, 6, 7], greedy(3))
        await engine.abort(result.request_id)  # already finished
        await engine.abort("never-existed")
        again = await run_request(engine, [5, 6, 7], greedy(3))  # the engine keeps serving
        assert again.token_ids == result.token_ids
        await assert_drained(engine)
        assert not engine.scheduler.requests
