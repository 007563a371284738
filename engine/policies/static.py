"""Static batching, the baseline, built faithfully so its waste can be measured.

Gather up to `max_num_seqs` requests (or whatever arrived within `batch_timeout_ms`, or as many
as the waiting queue holds, `max_waiting`, when that is fewer: no more could join), pad
every prompt to the longest and compute the padding, then decode until the longest request
finishes: a finished request stays in the batch as one padding token per step, and its
final output is delivered only when the batch ends. New requests wait for the whole batch.

The padding is computed as a padded batch computes it: a prompt's pad tokens sit after its
prompt, in the same sequence, and attend to it; a finished request's pad token attends to
its whole context. Their KV is never stored and nothing is sampled from them.
"""

from __future__ import annotations

from engine.policies.base import BasePolicy, Decision, Idle, admit_waiting, register


MIN_WAIT_S = 1e-6


@register
class StaticPolicy(BasePolicy):
    name = "static"
    uses_prefix_cache = False

    def __init__(self, config):
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.timeout_s = config.scheduler.batch_timeout_ms / 1000
        self.max_waiting = config.scheduler.max_waiting
        self.batch: list = []

    def schedule(self, view) -> list[Decision] | Idle:
        if not self.batch:
            return self._start_batch(view)
        decisions: list[Decision] = []
        for req in list(self.batch):
            if req.is_finished:
                decisions.append(Decision(req, 0, num_padding=1))
            elif view.is_running(req) and view.grow(req, 1, decisions):
                decisions.append(Decision(req, req.num_tokens - req.num_computed_tokens))
        return decisions or Idle()

    def _start_batch(self, view) -> list[Decision] | Idle:
        if not view.waiting:
            return Idle()
        left = view.waiting[0].arrival_time + self.timeout_s - view.now()
        # a wait under a microsecond is over: on the simulator's float clock, arrival + timeout
        # minus the arrival can stay ulps short of the timeout, and such an Idle moves no clock
        # a full waiting queue starts the batch too: intake refuses whatever would join it
        filling = sum(r.num_seqs for r in view.waiting) < self.max_num_seqs and len(view.waiting) < self.max_waiting
        if filling and left > MIN_WAIT_S:
            return Idle(left)
        decisions: list[Decision] = []
        admit_waiting(view, decisions, self.max_num_seqs)
        self.batch = [d.request for d in decisions]
        longest = max((d.num_tokens for d in decisions), default=0)
        for d in decisions:
            d.num_padding = longest - d.num_tokens
        return decisions or Idle()

    def forked(self, request, children) -> None:
        self.batch.extend(children)  # a group's choices sit in its batch

    def holds_finished(self, request) -> bool:
        return request in self.batch

    def forget(self, request) -> None:
        if request in self.batch:
            self.batch.remove(request)

    def end_step(self, view) -> None:
        """The batch ends with the step its last request finished in: all final outputs and
        their finish records go out with that step, not with the next batch's first."""
        if self.batch and all(r.is_finished for r in self.batch):
            for req in self.batch:
                view.release(req)
            self.batch = []
