"""Chunked prefill under a per-step token budget: running decodes first (one token each),
then partial prefills continue, then new requests start, each prompt piece at most
`chunk_size` tokens — all packed into the same forward step."""

from __future__ import annotations

from engine.policies.base import Decision, Idle


class ChunkedPolicy:
    name = "chunked"
    uses_prefix_cache = True

    def __init__(self, config):
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.chunk_size = config.scheduler.chunk_size

    async def schedule(self, s) -> list[Decision] | Idle:
        decisions: list[Decision] = []
        budget = self.token_budget
        running = s.running_in_order()
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, self.chunk_size, budget)
            if s.is_running(req) and await s.reserve(req, n, decisions):
                decisions.append(Decision(req, n))
                budget -= n
        while budget > 0 and s.waiting and len(s.running) < self.max_num_seqs and not s.preempted_this_step:
            req = s.waiting[0]
            n = await s.admit(req, min(self.chunk_size, budget))
            if n == 0:
                break
            decisions.append(Decision(req, n))
            budget -= n
        return decisions or Idle()

    def hold_finished(self, request) -> bool:
        return False

    def forget(self, request) -> None:
        pass

    def end_step(self, s) -> None:
        pass
