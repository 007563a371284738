"""Structured-output rows for step benchmarks (the step-overhead benchmark's 8 constrained
requests): matchers on a grammar that never has to end, so any number of steps stay constrained.

    matchers = bench_matchers(loaded.tokenizer, model.shape.vocab_size, loaded.eos_token_ids, 8)
    PlanItem(..., grammar=matchers[i])   # or constrain(logits, rows) / advance(rows, tokens) directly
    rearm(matchers)                      # between steps: random logits may close the array and end it
"""

from __future__ import annotations

import asyncio

import xgrammar as xgr

from engine.structured.compiler import GrammarCache
from engine.structured.spec import StructuredOutput

# An array of objects with free strings and numbers: every step has a real mask to fill. Random
# logits may close the array (then the matcher ends): `rearm` starts such matchers over.
BENCH_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "score": {"type": "number"}}, "required": ["name", "score"]}}


def bench_matchers(tokenizer, vocab_size: int, stop_token_ids: frozenset[int], n: int) -> list[xgr.GrammarMatcher]:
    """n fresh matchers (compiled once, through the engine's own cache and compiler)."""
    cache = GrammarCache(tokenizer, vocab_size, stop_token_ids)
    compiled = asyncio.run(cache.get(StructuredOutput.from_schema(BENCH_SCHEMA)))
    return [cache.matcher(compiled) for _ in range(n)]


def rearm(matchers: list[xgr.GrammarMatcher]) -> None:
    """Start over every matcher that reached the end of its grammar (an engine request would
    have finished there; a benchmark row keeps going)."""
    for m in matchers:
        if m.is_terminated():
            m.reset()
