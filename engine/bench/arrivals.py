"""When each request of a peer run is sent: the in-process runner's schedule (`_paced`), for
peers that pace requests themselves in one thread instead of with asyncio tasks."""

from __future__ import annotations

from engine.bench.workload import BenchRequest


class Arrivals:
    """When each request is sent, as the runner's `_paced` does: at `start + arrival_s`; a gated
    one also not before the run received `after_tokens` output tokens in all, or every ungated
    request is done (a gate that can no longer open opens anyway)."""

    def __init__(self, requests: list[BenchRequest], start: float):
        self.requests, self.start = requests, start
        self.unsent = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)  # arrival order
        self.opened: dict[int, float] = {i: 0.0 for i, r in enumerate(requests) if not r.after_tokens}
        self.num_received = 0
        self.num_ungated_left = len(self.opened)
        self._open_gates(start)  # with no ungated request, every gate is open from the start

    def due(self, now: float) -> list[tuple[int, float]]:
        """Pop the requests sent by `now`, in arrival order, each with its send time."""
        out = [(i, max(self.start + self.requests[i].arrival_s, self.opened[i])) for i in self.unsent
               if i in self.opened and self.start + self.requests[i].arrival_s <= now]
        sent = {i for i, _ in out}
        self.unsent = [i for i in self.unsent if i not in sent]
        return out

    def next_at(self) -> float | None:
        """The next send time known now (gates still shut open only on tokens or finishes)."""
        return min((self.start + self.requests[i].arrival_s for i in self.unsent if i in self.opened), default=None)

    def receive(self, num_tokens: int, now: float) -> None:
        self.num_received += num_tokens
        self._open_gates(now)

    def finish(self, index: int, now: float) -> None:
        if not self.requests[index].after_tokens:
            self.num_ungated_left -= 1
            self._open_gates(now)

    def _open_gates(self, now: float) -> None:
        for i in self.unsent:
            need = self.requests[i].after_tokens
            if i not in self.opened and (self.num_received >= need or not self.num_ungated_left):
                self.opened[i] = now
