"""A stand-in PlanView for policy unit tests: queues and a block budget, no engine."""

from __future__ import annotations

from types import SimpleNamespace

from engine.request import Request, SamplingParams, Status


def request(i: int, prompt_len: int, computed: int = 0, outputs: int = 0, priority: int = 0) -> Request:
    req = Request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(priority=priority), None, None, i)
    req.output_token_ids = [7] * outputs
    req.num_computed_tokens = computed
    return req


def config(**scheduler) -> SimpleNamespace:
    base = dict(max_num_seqs=64, max_num_batched_tokens=512, chunk_size=256, batch_timeout_ms=0, max_step_ms=0,
                min_chunk=32, max_waiting=1024)
    return SimpleNamespace(scheduler=SimpleNamespace(**{**base, **scheduler}),
                           cache=SimpleNamespace(enable_prefix_caching=True))


class FakeView:
    """Room is counted in tokens (`capacity`); growing past it preempts the newest running."""

    can_predict = False  # no step-cost model

    def __init__(self, running=(), waiting=(), capacity: int = 10**9, now: float = 0.0):
        self.running = list(running)
        self.waiting = list(waiting)
        for r in self.running:
            r.status = Status.RUNNING
        self.capacity = capacity - sum(r.num_computed_tokens for r in self.running)
        self.preempted = False
        self.released: list[Request] = []
        self._now = now

    @property
    def num_running(self) -> int:
        return len(self.running)

    def now(self) -> float:
        return self._now

    def running_in_order(self):
        return sorted(self.running, key=lambda r: r.sort_key)

    def is_running(self, req) -> bool:
        return req.status is Status.RUNNING

    def grow(self, req, n, decisions) -> bool:
        while n > self.capacity:
            victim = max(self.running, key=lambda r: r.sort_key)
            self.running.remove(victim)
            victim.status = Status.WAITING
            self.capacity += victim.num_computed_tokens
            self.preempted = True
            decisions[:] = [d for d in decisions if d.request is not victim]
            if victim is req:
                return False
        self.capacity -= n
        return True

    def admit(self, req, max_new, min_new=1) -> int:
        n = min(max_new, self.capacity)
        if n < min_new or n == 0:
            return 0
        self.capacity -= n
        self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    def release(self, req) -> None:
        self.released.append(req)
