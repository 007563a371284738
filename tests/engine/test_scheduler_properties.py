"""Scheduler properties under random load (tiny model, hypothesis): random prompt lengths,
max_tokens, late arrivals, aborts, n > 1 choices (forked KV blocks, copy-on-write) and KV
pools small enough to force preemption, under all three policies. Checked:

- inside every step (a fault_hook that inspects the StepPlan in the worker thread): each
  item has blocks for all its positions, the slots written this step never collide, a block
  being written belongs to that item alone, and a block two items share is a read-only
  prefix block (same index in both tables, fully before both items' new tokens); chunked
  steps stay within the token budget;
- in the StepRecords: chunked never exceeds its budget, at most max_num_seqs requests run,
  padding only under static;
- every request ends, each of its choices once; the others with "length", exactly max_tokens
  tokens, equal to the model's own greedy continuation (aborted ones: a prefix of it);
- afterwards: nothing running or waiting, every KV block free, BlockPool invariants hold.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.messages import StepPlan
from tests.engine.util import POLICIES, Result, StepRecorder, assert_drained, greedy, tiny_config
from tests.paged import PagedRunner

MAX_PROMPT, MAX_TOKENS = 30, 16
EXAMPLES = int(os.environ.get("STEPWISE_PROPERTY_EXAMPLES", "20"))  # raise locally for a deeper search


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    arrive_at_step: int  # submitted once the engine has run this many steps (or is idle)
    abort_after: int | None  # engine.abort after this many outputs (0: right after submit)
    n: int = 1  # choices (capped at max_num_seqs)


tokens = st.integers(3, 258)


@st.composite
def workloads(draw):
    shared = draw(st.lists(tokens, min_size=0, max_size=24))  # common prefixes: prefix-cache hits
    specs = []
    for _ in range(draw(st.integers(1, 8))):
        head = shared[: draw(st.sampled_from([0, len(shared), len(shared)]) | st.integers(0, len(shared)))]
        tail = draw(st.lists(tokens, min_size=1, max_size=MAX_PROMPT - len(head)))
        specs.append(Spec(
            prompt=head + tail,
            max_tokens=draw(st.integers(1, MAX_TOKENS)),
            arrive_at_step=draw(st.sampled_from([0, 0, 0, 1, 3, 6, 12])),
            abort_after=draw(st.none() | st.none() | st.integers(0, 4)),
            n=draw(st.sampled_from([1, 1, 1, 2, 3])),
        ))
    block_size = draw(st.sampled_from([2, 4, 8]))
    need = max(-(-(len(s.prompt) + s.max_tokens) // block_size) for s in specs)
    num_blocks = need + draw(st.integers(0, need))  # slack 0: the largest request alone fills the pool
    knobs = dict(
        block_size=block_size, num_blocks=num_blocks, max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 48)), chunk_size=draw(st.integers(1, 24)),
    )
    for spec in specs:
        spec.n = min(spec.n, knobs["max_num_seqs"])
    return specs, knobs


class PlanChecker:
    """The fault_hook: runs in the executor's worker thread, so it records, never raises."""

    def __init__(self, block_size: int, policy: str):
        self.bs = block_size
        self.policy = policy
        self.violations: list[str] = []
        self.num_steps = 0

    def __call__(self, plan: StepPlan) -> None:
        try:
            self._check(plan)
        except Exception as e:  # a bug in the checker itself must surface too
            self.violations.append(f"step {plan.step}: checker crashed: {e!r}")

    def _check(self, plan: StepPlan) -> None:
        self.num_steps += 1
        bs, bad = self.bs, self.violations.append
        items = [it for it in plan.items if it.kind != "padding"]
        if self.policy == "chunked" and sum(len(it.token_ids) for it in items) > plan.token_budget:
            bad(f"step {plan.step}: {sum(len(it.token_ids) for it in items)} tokens > budget {plan.token_budget}")
        if self.policy != "static" and (len(items) != len(plan.items) or any(it.num_padding for it in items)):
            bad(f"step {plan.step}: padding under {self.policy}")
        if len({it.request_id for it in items}) != len(items):
            bad(f"step {plan.step}: a request appears twice")
        written: dict[int, str] = {}  # slot -> request
        writes_block: dict[int, str] = {}  # block -> request writing into it
        for it in items:
            table, end = it.block_table, it.start_pos + len(it.token_ids) - it.num_padding  # pads are not stored
            if not it.token_ids:
                bad(f"step {plan.step}: empty item for {it.request_id}")
            if len(set(table)) != len(table):
                bad(f"step {plan.step}: {it.request_id} has a block twice in its table {table}")
            if len(table) * bs < end:
                bad(f"step {plan.step}: {it.request_id} writes position {end - 1} beyond its {len(table)} blocks")
                continue
            for pos in range(it.start_pos, end):
                block = table[pos // bs]
                slot = block * bs + pos % bs
                if slot in written:
                    bad(f"step {plan.step}: slot {slot} written by {written[slot]} and {it.request_id}")
                written[slot] = it.request_id
                writes_block[block] = it.request_id
        where: dict[int, list[tuple[str, int, int]]] = {}  # block -> (request, index, start_pos)
        for it in items:
            for i, block in enumerate(it.block_table):
                where.setdefault(block, []).append((it.request_id, i, it.start_pos))
        for block, owners in where.items():
            if len(owners) < 2:
                continue
            if block in writes_block:
                bad(f"step {plan.step}: block {block} written by {writes_block[block]} is also in the tables of "
                    f"{[o[0] for o in owners if o[0] != writes_block[block]]}")
            if len({i for _, i, _ in owners}) != 1 or any((i + 1) * bs > start for _, i, start in owners):
                bad(f"step {plan.step}: block {block} shared but not as a computed prefix block: {owners}")


@pytest.fixture(scope="module")
def reference(tiny_ours):
    """Greedy continuation of a prompt by the model alone (no engine), memoised."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = PagedRunner(tiny_ours, num_blocks=8, block_size=16).greedy(0, prompt, MAX_TOKENS)
        return cache[key]

    return get


async def scenario(tiny_model, policy: str, specs: list[Spec], knobs: dict, reference) -> None:
    checker = PlanChecker(knobs["block_size"], policy)
    cfg = tiny_config(policy=policy, **knobs)
    async with Engine(cfg, loaded=tiny_model, fault_hook=checker) as engine:
        recorder = await StepRecorder(engine).start()

        def idle() -> bool:
            snap = engine.snapshot()
            return not snap.running and not snap.waiting

        async def client(spec: Spec) -> Result:
            while engine.snapshot().step < spec.arrive_at_step and not idle():
                await asyncio.sleep(0.001)
            result = Result(await engine.submit(spec.prompt, greedy(spec.max_tokens, n=spec.n)))
            if spec.abort_after == 0:
                await engine.abort(result.request_id)
            async for out in engine.stream(result.request_id):
                result.outputs.append(out)
                if spec.abort_after is not None and len(result.outputs) == spec.abort_after:
                    await engine.abort(result.request_id)
            return result

        async with asyncio.timeout(60):
            results = await asyncio.gather(*(client(s) for s in specs))
        await assert_drained(engine)
        records = await recorder.caught_up()
        recorder.stop()

    assert not checker.violations, "\n".join(checker.violations[:10])
    steps = [r for r in records if not r.is_idle]  # idle records only report aborts
    assert checker.num_steps == len(steps) and (not steps or steps[-1].step == len(steps))
    assert steps or all(s.abort_after == 0 for s in specs)  # no step: everything was aborted at once
    for spec, r in zip(specs, results):
        ends = [o for o in r.outputs if o.finished]
        assert sorted(o.index for o in ends) == list(range(spec.n)) and r.outputs[-1].finished
        for final in ends:
            tokens = [t for o in r.outputs if o.index == final.index for t in o.token_ids]
            assert final.error is None
            assert final.num_generated_tokens == len(tokens)
            assert tokens == reference(spec.prompt)[: len(tokens)], "tokens differ from the model's greedy text"
            if spec.abort_after is None:
                assert final.finish_reason == "length" and len(tokens) == spec.max_tokens
            else:
                assert final.finish_reason in ("abort", "length")
                if final.finish_reason == "length":
                    assert len(tokens) == spec.max_tokens
    event(f"preempted: {bool(records and records[-1].num_preemptions)}")
    event(f"prefix hit: {any(r.final.num_cached_tokens for r in results)}")
    event(f"aborted: {any(r.final.finish_reason == 'abort' for r in results)}")
    event(f"forked: {any(s.n > 1 for s in specs)}")
    event(f"mixed prefill+decode step: {any(r.num_prefill_tokens and r.num_decode_tokens for r in records)}")
    for rec in steps:
        real_items = [it for it in rec.items if it.kind != "padding"]
        assert len(real_items) <= knobs["max_num_seqs"]
        assert rec.kv_usage <= 1.0
        if policy == "chunked":
            assert rec.token_budget == knobs["max_num_batched_tokens"]
            assert rec.num_prefill_tokens + rec.num_decode_tokens <= rec.token_budget
        if policy != "static":
            assert rec.num_padding_tokens == 0


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=workloads())
def test_scheduler_properties(tiny_model, reference, policy, workload):
    specs, knobs = workload
    asyncio.run(scenario(tiny_model, policy, specs, knobs, reference))
