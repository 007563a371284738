"""A few synthetic steps at start-up, so the step-cost model predicts from the first real step.

Runs decode batches and prompt chunks of a few sizes straight through the executor (before
any request exists: the KV blocks they write are free and never committed), and feeds their
forward times to the model. About a dozen steps; under 3 s for the default model on 2 cores.
"""

from __future__ import annotations

from engine.messages import PlanItem, StepPlan
from engine.scheduler import plan_shape
from engine.step_cost import StepCostModel

# (sequences, context each); two contexts at 32 sequences: a decode's K/V reads apart from its rows
DECODE_BATCHES = ((1, 64), (8, 256), (32, 128), (32, 512), (64, 64))
# (tokens, context); one chunk deep into a long prompt, whose query-key pairs cost less each than
# a decode's (without it, the first long prompt's later chunks were predicted 17-24 % too slow)
PREFILL_CHUNKS = ((32, 0), (128, 0), (256, 256), (512, 0), (256, 1536))


def calibration_plans(block_size: int, num_blocks: int, max_len: int, split_rows: int | None = None) -> list[StepPlan]:
    """`split_rows`: the cost model fits steps of at most that many rows apart; a decode batch
    of that size gives its small side a point at its edge."""
    plans = []
    batches = DECODE_BATCHES if split_rows is None else sorted({*DECODE_BATCHES, (split_rows, 128)})
    for seqs, ctx in batches:
        plans.append(_plan([(1, ctx)] * seqs, block_size, num_blocks, max_len))
    for tokens, ctx in PREFILL_CHUNKS:
        plans.append(_plan([(tokens, ctx)], block_size, num_blocks, max_len))
    plans.append(_plan([(1, 128)] * 16 + [(128, 128)], block_size, num_blocks, max_len))  # a mixed step
    return [p for p in plans if p is not None]


def _plan(items: list[tuple[int, int]], block_size: int, num_blocks: int, max_len: int) -> StepPlan | None:
    out, next_block = [], 0
    for n, ctx in items:
        if ctx + n > max_len:
            return None  # a short-context model (tests): skip this shape
        blocks = -(-(ctx + n) // block_size)
        if next_block + blocks > num_blocks:
            return None  # a small pool (tests): skip this shape
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        out.append(PlanItem(request_id=f"calibration-{len(out)}", kind="decode" if n == 1 else "prefill",
                            token_ids=[1] * n, start_pos=ctx, block_table=table, sample=True))
    return StepPlan(step=0, items=out, token_budget=0)


def calibrate(executor, model: StepCostModel, num_blocks: int, max_len: int, rounds: int = 2) -> None:
    plans = calibration_plans(executor.block_size, num_blocks, max_len, model.split_rows)
    if not plans:
        return
    executor.run_plan(plans[0])  # warm-up: first-call costs (kernel loads) are not a step's
    for _ in range(rounds):
        for plan in plans:
            forward_s = executor.run_plan(plan).forward_s
            model.observe(plan_shape(plan), forward_s)
    model.fit()
