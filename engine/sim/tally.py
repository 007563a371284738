"""Step figures of a simulated run, summed as the steps are published (a one-hour run on 32
replicas takes millions of steps: keeping their records would cost gigabytes). The figures
and their definitions are engine-bench's (`engine.bench.report.result`), summed over replicas."""

from __future__ import annotations

from engine.messages import StepRecord


class StepTally:
    def __init__(self):
        self.num_steps = 0
        self.padding = 0
        self.total = 0
        self.cached = 0
        self.prefilled = 0  # recomputation after preemption included
        self.preemptions: dict[int, int] = {}  # replica -> its cumulative count

    def add(self, replica: int, rec: StepRecord) -> None:
        self.num_steps += 1
        self.padding += rec.num_padding_tokens
        self.total += rec.num_prefill_tokens + rec.num_decode_tokens + rec.num_padding_tokens
        self.cached += rec.num_cached_tokens
        self.prefilled += rec.num_prefill_tokens
        self.preemptions[replica] = rec.num_preemptions

    def figures(self) -> dict:
        seen = self.cached + self.prefilled
        return {
            "num_steps": self.num_steps,
            "padding_waste_pct": 100 * self.padding / self.total if self.total else 0.0,
            "preemptions": sum(self.preemptions.values()),
            "prefix_cache_hit_rate": self.cached / seen if seen else 0.0,
            "tokens_processed": self.total,
        }
