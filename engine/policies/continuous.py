"""Iteration-level batching: every step, running requests decode one token each; finished
ones have already left; waiting requests join while there is room, their whole prompt
prefilled in the step they join."""

from __future__ import annotations

from engine.policies.base import Decision, Idle


class ContinuousPolicy:
    name = "continuous"
    uses_prefix_cache = True

    def __init__(self, config):
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.token_budget = 0  # no per-step budget: prompts go in whole

    async def schedule(self, s) -> list[Decision] | Idle:
        decisions: list[Decision] = []
        for req in s.running_in_order():
            if s.is_running(req) and await s.reserve(req, req.num_tokens - req.num_computed_tokens, decisions):
                decisions.append(Decision(req, req.num_tokens - req.num_computed_tokens))
        while s.waiting and len(s.running) < self.max_num_seqs and not s.preempted_this_step:
            req = s.waiting[0]
            n = await s.admit(req, req.num_tokens)
            if n == 0:
                break
            decisions.append(Decision(req, n))
        return decisions or Idle()

    def hold_finished(self, request) -> bool:
        return False

    def forget(self, request) -> None:
        pass

    def end_step(self, s) -> None:
        pass
