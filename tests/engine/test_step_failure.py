"""A step that raises fails only the requests in it; three failures in a row kill the engine,
which then refuses new work — and nothing ever hangs. A row left with no token to sample fails
its own request only."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest

from engine import Engine, EngineDeadError, SamplingParams, StructuredOutput
from engine.errors import RequestError
from tests.engine.util import StepRecorder, assert_drained, greedy, run_all, run_request, tiny_config

PROMPTS = [list(range(10 + i, 50 + 2 * i)) for i in range(4)]  # 40..46 tokens: several whole blocks


class FailOnce:
    """Raise on the first step that contains a request whose id starts with `prefix`."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.failed_ids: set[str] | None = None
        self.failed_step: int | None = None

    def __call__(self, plan) -> None:
        if self.failed_ids is None and any(it.request_id.startswith(self.prefix) for it in plan.items):
            self.failed_ids = {it.request_id for it in plan.items if it.kind != "padding"}
            self.failed_step = plan.step
            raise RuntimeError("injected fault")


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
async def test_one_failed_step_fails_only_its_requests(tiny_model, policy):
    hook = FailOnce("doomed")
    cfg = tiny_config(policy=policy, max_num_seqs=2, block_size=16)
    async with asyncio.timeout(60):
        async with Engine(cfg, loaded=tiny_model) as ref_engine:
            reference = {i: (await run_request(ref_engine, p, greedy(12))).token_ids for i, p in enumerate(PROMPTS)}
        async with Engine(cfg, loaded=tiny_model, fault_hook=hook) as engine:
            recorder = await StepRecorder(engine).start()
            # max_num_seqs=2: the first two share the first step (which fails), the others wait
            ids = [f"doomed-{i}" if i < 2 else f"later-{i}" for i in range(4)]
            results = await asyncio.gather(*(run_request(engine, p, greedy(12), request_id=rid)
                                             for p, rid in zip(PROMPTS, ids)))
            assert hook.failed_ids and hook.failed_ids <= set(ids)
            for r in results:
                if r.request_id in hook.failed_ids:
                    assert r.finish_reason == "error", r.request_id
                    assert r.final.error and "injected fault" in r.final.error
                else:
                    assert r.finish_reason == "length" and r.final.error is None
                    assert r.token_ids == reference[ids.index(r.request_id)]
            assert {"later-2", "later-3"}.isdisjoint(hook.failed_ids)
            # later requests — including ones with the failed requests' exact prompts, which
            # must not be served KV that the failed step never wrote — succeed with the same text
            for i in range(2):
                again = await run_request(engine, PROMPTS[i], greedy(12))
                assert again.finish_reason == "length"
                assert again.token_ids == reference[i], "a failed step left bad KV in the prefix cache"
            records = await recorder.caught_up()
            failed = [r for r in records if r.error]
            assert [r.step for r in failed] == [hook.failed_step] and "injected fault" in failed[0].error
            assert failed[0].forward_s == 0.0  # the hook raised before the forward
            assert all(0 < r.forward_s <= r.duration_s for r in records if not r.error)
            assert not engine.dead
            await assert_drained(engine)
            recorder.stop()


async def test_three_consecutive_failures_kill_the_engine(tiny_model):
    def always(plan):
        raise RuntimeError("executor on fire")

    async with asyncio.timeout(30):
        async with Engine(tiny_config(policy="chunked"), loaded=tiny_model, fault_hook=always) as engine:
            watcher = asyncio.create_task(_count(engine.steps()))  # a step watcher ends when the engine dies
            outcomes = []
            # Keep submitting the moment the previous request ends, as a busy client would:
            # every submission must either be refused or end (with "error"), never hang.
            for i in range(10):
                try:
                    r = await run_request(engine, [5, 6, 7, 8], greedy(4))
                except EngineDeadError:
                    outcomes.append("refused")
                    break
                outcomes.append(r.finish_reason)
                assert r.final.error and "executor on fire" in r.final.error
            assert outcomes[:3] == ["error"] * 3 and outcomes[-1] == "refused", outcomes
            while not engine.dead:  # bounded by the timeout above
                await asyncio.sleep(0.005)
            assert "3 steps in a row" in engine.dead
            assert await asyncio.wait_for(watcher, 5) >= 3  # it used to wait until stop()
            assert await asyncio.wait_for(_count(engine.steps()), 5) == 0  # a new one ends at once
            with pytest.raises(EngineDeadError):
                await engine.submit([1, 2, 3], greedy(2))
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate([1, 2, 3], greedy(2)):
                    pass


async def _count(records) -> int:
    return len([r async for r in records])


async def test_concurrent_requests_when_the_engine_dies_all_end(tiny_model):
    """Requests in flight (running or still waiting) when the engine dies all get a final
    output; none is left hanging."""

    def always(plan):
        raise RuntimeError("boom")

    async with asyncio.timeout(30):
        async with Engine(tiny_config(policy="continuous", max_num_seqs=1), loaded=tiny_model, fault_hook=always) as engine:
            results = await run_all(engine, [[i + 3] * 5 for i in range(6)], [greedy(3)] * 6, timeout=20)
            assert all(r.finish_reason == "error" for r in results)
            while not engine.dead:
                await asyncio.sleep(0.005)
            with pytest.raises(EngineDeadError):
                await engine.submit([1, 2], greedy(1))


async def test_request_arriving_during_the_fatal_step_is_not_orphaned(tiny_model):
    """A request accepted while the third failing step runs (so before the engine knows it is
    dead) must still end, with "error"."""
    in_third, release = threading.Event(), threading.Event()
    calls = {"n": 0}

    def hook(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            in_third.set()
            release.wait(10)  # hold the fatal step until the late request is accepted
        raise RuntimeError("boom")

    async with asyncio.timeout(30):
        async with Engine(tiny_config(policy="chunked"), loaded=tiny_model, fault_hook=hook) as engine:
            for _ in range(2):
                assert (await run_request(engine, [3, 4, 5], greedy(2))).finish_reason == "error"
            third = asyncio.create_task(run_request(engine, [3, 4, 5], greedy(2)))
            while not in_third.is_set():
                await asyncio.sleep(0.005)
            late_id = await engine.submit([6, 7, 8], greedy(2))  # accepted: the engine is not dead yet
            release.set()
            assert (await third).finish_reason == "error"
            late = [o async for o in engine.stream(late_id)]
            assert late[-1].finished and late[-1].finish_reason == "error"
            while not engine.dead:
                await asyncio.sleep(0.005)


async def test_a_failure_streak_is_reset_by_a_good_step(tiny_model):
    calls = {"n": 0}

    def every_other(plan):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("flaky")

    async with asyncio.timeout(30):
        async with Engine(tiny_config(policy="chunked"), loaded=tiny_model, fault_hook=every_other) as engine:
            reasons = [(await run_request(engine, [7, 8, 9], greedy(1))).finish_reason for _ in range(8)]
            assert reasons == ["error", "length"] * 4
            assert not engine.dead
            await assert_drained(engine)


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
async def test_a_row_with_nothing_to_sample_fails_alone(tiny_model, policy, monkeypatch):
    """Structured output whose grammar must end while min_tokens still masks EOS leaves its row
    no token. Such a request is refused at submit now (a 400 naming min_tokens); the executor's
    defence behind that check is tested here with the check skipped: that request ends with an
    error saying why, the others in its steps go on, and repeats of it are not failed steps
    (three used to kill the engine). min_p under a grammar keeps a token: the grammar masks
    first, so min_p's most likely token is an allowed one."""
    boolean, anything = StructuredOutput.from_schema({"type": "boolean"}), StructuredOutput.from_schema({"type": "object"})
    stuck = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, structured_output=boolean)
    with pytest.raises(RequestError, match="min_tokens cannot be combined with structured output"):
        stuck.validate()
    checked = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda p: checked(msgspec.structs.replace(p, min_tokens=0)))
    min_p = SamplingParams(max_tokens=8, temperature=1.0, min_p=0.9, seed=1, structured_output=anything)
    # ignore_eos leaves EOS unmasked: the grammar ends on it and the request runs on (a matcher asked
    # for a mask after its end used to raise, failing the step)
    complete = msgspec.structs.replace(stuck, ignore_eos=True)
    params = [stuck, greedy(12), stuck, min_p, complete, stuck]
    async with asyncio.timeout(60), Engine(tiny_config(policy=policy), loaded=tiny_model) as engine:
        results = await run_all(engine, [PROMPTS[0]] * len(params), params)
        assert not engine.scheduler.dead
        again = await run_request(engine, PROMPTS[1], greedy(4))
    for r in (results[0], results[2], results[4], results[5]):
        assert r.finish_reason == "error" and "min_tokens" in r.final.error, r.final
    assert "the structured output is complete before min_tokens was reached" in results[4].final.error
    assert results[1].finish_reason == "length" and len(results[1].token_ids) == 12
    assert results[3].finish_reason in ("length", "stop") and results[3].final.error is None
    assert again.finish_reason == "length" and len(again.token_ids) == 4
