"""Iteration-level batching: every step, running requests decode one token each; finished
ones have already left; waiting requests join while there is room, their whole prompt
prefilled in the step they join."""

from __future__ import annotations

from engine.policies.base import BasePolicy, Decision, Idle, admit_waiting, register


@register
class ContinuousPolicy(BasePolicy):
    name = "continuous"

    def __init__(self, config):
        self.max_num_seqs = config.scheduler.max_num_seqs

    def schedule(self, view) -> list[Decision] | Idle:
        decisions: list[Decision] = []
        for req in view.running_in_order():
            n = req.num_tokens - req.num_computed_tokens
            if view.is_running(req) and view.grow(req, n, decisions):
                decisions.append(Decision(req, n))
        admit_waiting(view, decisions, self.max_num_seqs)
        return decisions or Idle()
