"""n > 1 choices from one prompt (engine level, tiny model): the prompt is prefilled once, the
choices share its KV blocks (reference counts > 1 seen in the pool while they decode) and a
partly filled last block is copied on write — greedy choices equal the n=1 output, whatever
the prompt length — under all three policies, with other requests alongside, under
preemption, abort, and with the prefix cache on or off. Every block is free afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import Engine, RequestError, SamplingParams
from engine.messages import StepPlan
from tests.engine.util import POLICIES, Result, StepRecorder, assert_drained, greedy, run_all, run_request, tiny_config

BLOCK_SIZE = 4
MAX_TOKENS = 12


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(length)]


def choices(result: Result, n: int) -> list[list[int]]:
    """Each choice's tokens, by index (outputs of the choices interleave)."""
    assert {o.index for o in result.outputs} <= set(range(n))
    return [[t for o in result.outputs if o.index == i for t in o.token_ids] for i in range(n)]


def finals(result: Result, n: int) -> list:
    ends = [o for o in result.outputs if o.finished]
    assert sorted(o.index for o in ends) == list(range(n)), "each choice ends exactly once"
    assert result.outputs[-1].finished
    return sorted(ends, key=lambda o: o.index)


class Sharing:
    """fault_hook: in the executor's thread before each step (the block manager is idle then,
    waiting for the scheduler's next message), records the pool's reference counts of the
    blocks the plan's items use, and the plan's block copies."""

    def __init__(self):
        self.engine: Engine | None = None
        self.max_shared = 0  # highest reference count seen on a block in a plan
        self.copies: list[tuple[int, int]] = []
        self.plans: list[StepPlan] = []

    def __call__(self, plan: StepPlan) -> None:
        pool = self.engine.block_manager._pool
        self.plans.append(plan)
        self.copies += plan.block_copies
        for it in plan.items:
            self.max_shared = max([self.max_shared, *(pool.ref_count[b] for b in it.block_table)])


async def sharing_engine(tiny_model, **cfg) -> tuple[Engine, Sharing]:
    hook = Sharing()
    engine = Engine(tiny_config(block_size=BLOCK_SIZE, **cfg), loaded=tiny_model, fault_hook=hook)
    hook.engine = engine
    await engine.start()
    return engine, hook


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prompt_len", [13, 16], ids=["partial-last-block", "whole-blocks"])
async def test_greedy_choices_equal_the_single_output(tiny_model, policy, prompt_len):
    """Two greedy choices must both be the n=1 text: the copy of the shared partial block is
    right (a choice writing into it without a copy, or a copy of the wrong block, changes
    what the other attends to). Another request runs alongside."""
    p, other = prompt(prompt_len), prompt(9, seed=1)
    async with Engine(tiny_config(policy=policy, block_size=BLOCK_SIZE), loaded=tiny_model) as engine:
        single = await run_request(engine, p, greedy(MAX_TOKENS))
        alone = await run_request(engine, other, greedy(MAX_TOKENS))
    engine, hook = await sharing_engine(tiny_model, policy=policy, enable_prefix_caching=False)
    try:
        recorder = await StepRecorder(engine).start()
        both, beside = await run_all(engine, [p, other], [greedy(MAX_TOKENS, n=2), greedy(MAX_TOKENS)])
        records = await recorder.caught_up()
        recorder.stop()
        assert choices(both, 2) == [single.token_ids, single.token_ids]
        assert beside.token_ids == alone.token_ids
        assert [f.finish_reason for f in finals(both, 2)] == ["length", "length"]
        # the prompt is prefilled once, by choice 0; the other choice only decodes
        prefilled = [it for r in records for it in r.items if it.kind == "prefill" and it.request_id.startswith(both.request_id)]
        assert {it.request_id for it in prefilled} == {both.request_id}
        assert sum(it.num_tokens for it in prefilled) == prompt_len
        assert hook.max_shared > 1, "the choices never shared a block"
        # copy-on-write only when the prompt ends inside a block: one copy (the last writer keeps it)
        assert len(hook.copies) == (1 if prompt_len % BLOCK_SIZE else 0)
        await assert_drained(engine)
    finally:
        await engine.stop()


async def test_seeded_choices_differ_and_repeat(tiny_model):
    """n=3 with a seed: three distinct choices, the same three again with the same seed; choice
    0 is what n=1 with that seed samples (its generator keeps the seed)."""
    p = prompt(10)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, ignore_eos=True, n=3)
    engine, hook = await sharing_engine(tiny_model, policy="continuous")
    try:
        start_free = engine.block_manager.figures.num_free_blocks
        recorder = await StepRecorder(engine).start()
        first = await run_request(engine, p, params)
        records = await recorder.caught_up()
        recorder.stop()
        again = await run_request(engine, p, params)
        one = await run_request(engine, p, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1234,
                                                          ignore_eos=True))
        texts = choices(first, 3)
        assert len({tuple(t) for t in texts}) == 3, texts
        assert all(len(t) == MAX_TOKENS for t in texts)
        assert choices(again, 3) == texts
        assert texts[0] == one.token_ids
        prefill = sum(it.num_tokens for r in records for it in r.items if it.kind == "prefill")
        assert prefill == len(p), "the prompt must be prefilled once for the group"
        assert hook.max_shared == 3  # all three choices hold the prompt's blocks
        ends = finals(first, 3)
        assert all(f.num_prompt_tokens == len(p) and f.num_generated_tokens == MAX_TOKENS for f in ends)
        await assert_drained(engine)
        assert engine.block_manager.figures.num_free_blocks == start_free
    finally:
        await engine.stop()


@pytest.mark.parametrize("policy", POLICIES)
async def test_preempting_a_choice_keeps_every_output_right(tiny_model, policy):
    """A pool far too small for three groups of four choices: choices are preempted (each
    recomputes only itself, from the prompt and its own tokens) and every choice still ends
    with the greedy n=1 text; nothing is freed twice or lost."""
    prompts = [prompt(10, seed=s) for s in range(3)]
    async with Engine(tiny_config(policy=policy, block_size=BLOCK_SIZE), loaded=tiny_model) as engine:
        singles = [r.token_ids for r in await run_all(engine, prompts, [greedy(MAX_TOKENS)] * 3)]
    cfg = dict(policy=policy, num_blocks=14, max_num_batched_tokens=24, chunk_size=8, max_num_seqs=8)
    engine, hook = await sharing_engine(tiny_model, **cfg)
    try:
        recorder = await StepRecorder(engine).start()
        results = await run_all(engine, prompts, [greedy(MAX_TOKENS, n=4)] * 3, timeout=120)
        records = await recorder.caught_up()
        recorder.stop()
        for r, single in zip(results, singles):
            assert choices(r, 4) == [single] * 4
            assert all(f.finish_reason == "length" for f in finals(r, 4))
        assert records[-1].num_preemptions > 0, "the small pool never forced a preemption"
        recomputed = {it.request_id for r in records for it in r.items if it.kind == "prefill" and "#" in it.request_id}
        assert recomputed, "no forked choice was preempted and recomputed"
        assert max(len(r.items) for r in records) <= 8  # the choices count against max_num_seqs
        await assert_drained(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
async def test_forks_with_the_prefix_cache(tiny_model, prefix_caching):
    """The same prompt twice: the second group's prompt may come from the cache (blocks that
    the first group's choices shared and then freed) — outputs unchanged either way."""
    p = prompt(18)
    async with Engine(tiny_config(policy="continuous", block_size=BLOCK_SIZE), loaded=tiny_model) as engine:
        single = (await run_request(engine, p, greedy(MAX_TOKENS))).token_ids
    engine, _ = await sharing_engine(tiny_model, policy="continuous", enable_prefix_caching=prefix_caching)
    try:
        a = await run_request(engine, p, greedy(MAX_TOKENS, n=3))
        b = await run_request(engine, p + [7], greedy(MAX_TOKENS, n=2))  # same prefix, longer
        c = await run_request(engine, p, greedy(MAX_TOKENS, n=2))
        assert choices(a, 3) == [single] * 3 and choices(c, 2) == [single] * 2
        assert len(set(map(tuple, choices(b, 2)))) == 1
        cached = finals(c, 2)[0].num_cached_tokens
        assert (cached > 0) == prefix_caching
        await assert_drained(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("policy", POLICIES)
async def test_choices_that_end_on_their_first_token(tiny_model, policy):
    """max_tokens=1: every choice ends in the step that forks it; all blocks come back."""
    async with Engine(tiny_config(policy=policy, block_size=BLOCK_SIZE), loaded=tiny_model) as engine:
        r = await run_request(engine, prompt(7), greedy(1, n=5))
        assert [len(t) for t in choices(r, 5)] == [1] * 5
        assert [f.finish_reason for f in finals(r, 5)] == ["length"] * 5
        await assert_drained(engine)


async def test_every_choice_is_timed_from_when_its_group_was_scheduled(tiny_model):
    """A forked choice never got its own stamp, so its queue time was its whole life."""
    async with Engine(tiny_config(policy="continuous", block_size=BLOCK_SIZE), loaded=tiny_model) as engine:
        recorder = await StepRecorder(engine).start()
        await run_request(engine, prompt(9), greedy(20, n=3))
        records = await recorder.caught_up()
        ends = [f for r in records for f in r.finished]
        assert len(ends) == 3
        queued = [f.queue_s for f in ends]  # each choice's arrival is stamped as it is built: microseconds apart
        assert max(queued) - min(queued) < 0.1 and all(f.queue_s < f.e2e_s and f.prefill_s > 0 for f in ends), ends
        recorder.stop()


async def test_aborting_a_group_ends_every_choice(tiny_model):
    async with Engine(tiny_config(policy="continuous", block_size=BLOCK_SIZE), loaded=tiny_model) as engine:
        async with asyncio.timeout(30):
            # aborted while its choices decode
            request_id = await engine.submit(prompt(9), greedy(200, n=3))
            outputs = []
            async for out in engine.stream(request_id):
                outputs.append(out)
                if len(outputs) == 4:
                    await engine.abort(request_id)
            r = Result(request_id, outputs)
            assert {f.finish_reason for f in finals(r, 3)} == {"abort"}
            # aborted before its prompt ran: the choices not yet forked end too
            request_id = await engine.submit(prompt(9), greedy(5, n=3))
            await engine.abort(request_id)
            r = Result(request_id, [o async for o in engine.stream(request_id)])
            assert {f.finish_reason for f in finals(r, 3)} == {"abort"}
        await assert_drained(engine)


async def test_n_is_validated(tiny_model):
    async with Engine(tiny_config(policy="continuous", max_num_seqs=4), loaded=tiny_model) as engine:
        for n in (0, 17, True):
            with pytest.raises(RequestError) as e:
                await engine.submit([5, 6], greedy(2, n=n))
            assert e.value.param == "n"
        with pytest.raises(RequestError, match="max_num_seqs") as e:
            await engine.submit([5, 6], greedy(2, n=5))  # could never run at once
        assert e.value.param == "n"
        r = await run_request(engine, [5, 6], greedy(2, n=4))
        assert len(finals(r, 4)) == 4
        await assert_drained(engine)


async def test_prompt_logprobs_come_once_with_choice_0(tiny_model):
    """n > 1 with prompt logprobs: the group's prompt is scored once; choice 0's first output
    carries every prompt position, the other choices none (and each choice its own logprobs)."""
    p = prompt(10, seed=3)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=9, ignore_eos=True, n=3, prompt_logprobs=2, logprobs=1)
    engine = Engine(tiny_config(block_size=BLOCK_SIZE, policy="chunked"), loaded=tiny_model)
    await engine.start()
    try:
        result = await run_request(engine, p, params)
        scored = [o for o in result.outputs if o.prompt_logprobs]
        assert [o.index for o in scored] == [0]
        assert [e.token_id for e in scored[0].prompt_logprobs] == p
        assert scored[0].prompt_logprobs[0].logprob is None
        for i in range(3):
            mine = [o for o in result.outputs if o.index == i]
            assert [e.token_id for o in mine for e in o.logprobs or []] == [t for o in mine for t in o.token_ids]
        await assert_drained(engine)
    finally:
        await engine.stop()
