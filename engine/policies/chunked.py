"""Chunked prefill under a per-step budget: running decodes first (one token each, never
skipped for a prefill), then partial prefills continue, then new requests start — all packed
into the same forward step.

Two budgets, both honoured:
- tokens: `max_num_batched_tokens` per step (a hard cap), and `chunk_size` per prompt piece;
- time (`max_step_ms` > 0, once the step-cost model is fitted): prefill tokens are added while
  the predicted step time stays within it. Prefills are then first-come-first-served: the
  oldest (priority, then arrival) takes all it can before the next gets any, so a second long
  prompt never slows the first one down, and `chunk_size` no longer splits the share. Every
  step still gives at least `min_chunk` tokens to a prefill, so prompts cannot starve when the
  decodes alone fill the budget. In a step where a prompt chunked over earlier steps gets its
  last piece, a younger prompt joins only if all of it fits (it gets its first token too): a
  partial chunk would hold back the older prompt's first token for one that has none to give
  (the chunk runs in the next step instead; what that costs is one step's fixed overhead).

A new prompt's chunk is sized as if it had no context: its prefix-cache hits (or, after a
preemption, its own blocks found again) are known only once the block manager grants the
step, and they put the chunk after the cached tokens, where each token attends to more. Under
a time budget, `granted` then cuts such a chunk back to what fits (at least `min_chunk`).
"""

from __future__ import annotations

from engine.policies.base import BasePolicy, Decision, Idle, admit_waiting, register
from engine.step_cost import shape_of


@register
class ChunkedPolicy(BasePolicy):
    name = "chunked"

    def __init__(self, config):
        s = config.scheduler
        self.max_num_seqs = s.max_num_seqs
        self.token_budget = s.max_num_batched_tokens
        self.chunk_size = s.chunk_size
        self.max_step_s = s.max_step_ms / 1000
        self.min_chunk = s.min_chunk

    def schedule(self, view) -> list[Decision] | Idle:
        decisions: list[Decision] = []
        budget = self.token_budget
        running = view.running_in_order()
        decodes, prefills = [], []
        for r in running:
            left = r.num_tokens - r.num_computed_tokens
            if left == 1:
                decodes.append(r)
            elif left > 1:
                prefills.append(r)
        granted = []  # (tokens, context, is a decode) of every decode granted, for the step's shape
        for req in decodes:
            if budget == 0:
                break
            if view.is_running(req) and view.grow(req, 1, decisions):
                decisions.append(Decision(req, 1))
                budget -= 1
                granted.append((1, req.num_computed_tokens, True))
        shape = shape_of(granted)  # what chained `plus` calls give, without a struct per decode
        timed = self.max_step_s > 0 and view.can_predict
        chunks = 0  # prefill pieces given this step
        full = False  # the time budget is used up: no later prompt gets a token (FCFS)
        whole_only = False  # an older chunked prompt finishes this step: younger ones join only whole

        def size(req, cap: int) -> int:
            """Tokens of `req`'s prompt for this step: all `cap` unless the time budget says less."""
            nonlocal full
            if not timed:
                return min(cap, self.chunk_size)
            if full:
                return 0
            ctx = req.num_computed_tokens
            fits = lambda n: view.predict(shape.plus(n, ctx, decode=False)) <= self.max_step_s  # noqa: E731
            lo, hi = 0, cap  # the largest n with fits(n): predictions grow with n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            full = lo < cap  # what is left of the budget is not for a younger prompt
            if whole_only and lo < req.num_tokens - req.num_computed_tokens:
                full = True
                return 0
            return lo if lo >= self.min_chunk or chunks else min(cap, self.min_chunk)

        for req in prefills:
            if budget == 0:
                break
            n = size(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:
                break
            if view.is_running(req) and view.grow(req, n, decisions):
                decisions.append(Decision(req, n))
                budget -= n
                shape = shape.plus(n, req.num_computed_tokens, decode=False)
                chunks += 1
                whole_only = whole_only or (timed and n == req.num_tokens - req.num_computed_tokens)
        if budget > 0:
            def admit_size(req, cap: int) -> int:
                nonlocal chunks, shape
                n = size(req, cap)
                if n:  # counted as if granted; the block manager may grant fewer, never more
                    shape = shape.plus(n, 0, decode=False)
                    chunks += 1
                return n

            admit_waiting(view, decisions, self.max_num_seqs, budget=budget, size=admit_size)
        return decisions or Idle()

    def granted(self, decisions: list[Decision], hits: list[Decision], view) -> None:
        """Cut back the chunks of admitted prompts that start after cached tokens to what the
        time budget allows now, oldest first (FCFS: a younger one is sized after it)."""
        if not hits or not (self.max_step_s > 0 and view.can_predict):
            return
        for i, d in enumerate(hits):
            younger = {id(e) for e in hits[i + 1:]}
            rest = view.shape(e for e in decisions if e is not d and id(e) not in younger)
            ctx = d.request.num_computed_tokens
            fits = lambda n: view.predict(rest.plus(n, ctx, decode=False)) <= self.max_step_s  # noqa: E731
            floor = min(d.num_tokens, self.min_chunk)  # as planning gives a prompt: no slower start
            if d.num_tokens == floor or fits(d.num_tokens):
                continue
            lo, hi = floor, d.num_tokens - 1  # the largest n that fits, at least the floor
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            d.num_tokens = lo
