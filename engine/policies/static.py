"""Static batching, the baseline, built faithfully so its waste can be measured.

Gather up to `max_num_seqs` requests (or whatever arrived within `batch_timeout_ms`), pad
every prompt to the longest and compute the padding, then decode until the longest request
finishes: a finished request stays in the batch as one padding token per step, and its
final output is delivered only when the batch ends. New requests wait for the whole batch.
"""

from __future__ import annotations

import time

from engine.policies.base import Decision, Idle


class StaticPolicy:
    name = "static"
    uses_prefix_cache = False

    def __init__(self, config):
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.timeout_s = config.scheduler.batch_timeout_ms / 1000
        self.token_budget = 0
        self.batch: list = []

    async def schedule(self, s) -> list[Decision] | Idle:
        if self.batch and all(r.is_finished for r in self.batch):
            for req in self.batch:
                s.release(req)
            self.batch = []
        if not self.batch:
            return await self._start_batch(s)
        decisions: list[Decision] = []
        for req in list(self.batch):
            if req.is_finished:
                decisions.append(Decision(req, 1, padding=True))
            elif s.is_running(req) and await s.reserve(req, 1, decisions):
                decisions.append(Decision(req, req.num_tokens - req.num_computed_tokens))
        return decisions or Idle()

    async def _start_batch(self, s) -> list[Decision] | Idle:
        if not s.waiting:
            return Idle()
        waited = time.monotonic() - s.waiting[0].arrival_time
        if len(s.waiting) < self.max_num_seqs and waited < self.timeout_s:
            return Idle(self.timeout_s - waited)
        decisions: list[Decision] = []
        while s.waiting and len(decisions) < self.max_num_seqs:
            req = s.waiting[0]
            n = await s.admit(req, req.num_tokens)
            if n == 0:
                break
            decisions.append(Decision(req, n))
            self.batch.append(req)
        longest = max((d.num_tokens for d in decisions), default=0)
        padding = [Decision(d.request, longest - d.num_tokens, padding=True) for d in decisions if d.num_tokens < longest]
        return decisions + padding or Idle()

    def hold_finished(self, request) -> bool:
        return request in self.batch

    def forget(self, request) -> None:
        if request in self.batch:
            self.batch.remove(request)
