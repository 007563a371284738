"""Chunked prefill under a per-step token budget: running decodes first (one token each),
then partial prefills continue, then new requests start, each prompt piece at most
`chunk_size` tokens — all packed into the same forward step."""

from __future__ import annotations

from engine.policies.base import BasePolicy, Decision, Idle, admit_waiting, register


@register
class ChunkedPolicy(BasePolicy):
    name = "chunked"

    def __init__(self, config):
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.chunk_size = config.scheduler.chunk_size

    def schedule(self, view) -> list[Decision] | Idle:
        decisions: list[Decision] = []
        budget = self.token_budget
        running = view.running_in_order()
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, self.chunk_size, budget)
            if view.is_running(req) and view.grow(req, n, decisions):
                decisions.append(Decision(req, n))
                budget -= n
        admit_waiting(view, decisions, self.max_num_seqs, budget=budget, chunk_size=self.chunk_size)
        return decisions or Idle()
