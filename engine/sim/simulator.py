"""Replay a trace through N simulated engine replicas behind a router, on a virtual clock.

Each request is sent at its `arrival_s` (a gated one — the spike workloads — once the run has
received its `after_tokens` output tokens, then `after_gate_s` later, as engine-bench sends
it), routed by the cluster's own `Router` (round-robin, least-loaded, or prefix: block-hash
affinity with SGLang's load-balance thresholds), and timed from send to each output.
The result is what engine-bench measures: a RequestTiming per request and the run's duration.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field

from engine.bench.arrivals import Arrivals
from engine.bench.stats import RequestTiming
from engine.block_hash import prefix_block_hashes
from engine.config import EngineConfig
from engine.messages import StepRecord
from engine.request import Request, SamplingParams
from engine.sim.calibration import Calibration
from engine.sim.noise import StepNoise
from engine.sim.clock import run_virtual
from engine.sim.replica import Delivery, NullDetokenizer, SimReplica
from engine.sim.tally import StepTally
from engine.sim.trace import TraceRequest, token_ids
from frontends.cluster.router import Router

ROUTERS = {"round-robin": "round-robin", "least-loaded": "least-loaded", "prefix-affinity": "prefix"}


@dataclass
class SimResult:
    timings: list[RequestTiming]
    duration_s: float  # simulated: from the start to the last request's end
    wall_s: float
    tally: StepTally
    steps: list[StepRecord] | None  # every step's record, when kept (replica 0's only, for plots)
    routed: list[int] = field(default_factory=list)  # requests sent to each replica

    @property
    def speedup(self) -> float:
        """Simulated seconds per wall-clock second."""
        return self.duration_s / self.wall_s if self.wall_s > 0 else float("inf")


def simulate(trace: list[TraceRequest], config: EngineConfig, calibration: Calibration, replicas: int = 1,
             router: str = "round-robin", keep_steps: bool = False, step_noise: bool = True,
             seed: int = 0) -> SimResult:
    """`step_noise`: draw each step's forward time around its prediction from the calibration's
    ratios (when it has them; replica i's generator seeded by (seed, i))."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose from {sorted(ROUTERS)}")
    wall = time.perf_counter()
    result = run_virtual(_simulate(trace, config, calibration, replicas, router, keep_steps,
                                   step_noise and calibration.forward_ratios is not None, seed))
    result.wall_s = time.perf_counter() - wall
    return result


async def _simulate(trace, config, calibration, num_replicas, router_name, keep_steps, noisy, seed) -> SimResult:
    loop = asyncio.get_running_loop()
    tally = StepTally()
    steps: list[StepRecord] | None = [] if keep_steps else None

    def publisher(i: int):
        def publish(rec: StepRecord) -> None:
            if rec.is_idle:
                return
            tally.add(i, rec)
            if steps is not None and i == 0:
                steps.append(rec)
        return publish

    replicas = [SimReplica(config, calibration, publisher(i),
                           StepNoise(calibration.forward_ratios, seed * 1_000_003 + i) if noisy else None)
                for i in range(num_replicas)]
    names = [str(i) for i in range(num_replicas)]
    router = Router.for_cluster(names, config.cluster, ROUTERS[router_name])
    block_size = config.cache.block_size
    timings: list[RequestTiming | None] = [None] * len(trace)
    routed = [0] * num_replicas
    all_done = loop.create_future()
    num_left = len(trace)
    gated = any(r.after_tokens for r in trace)
    # Request.arrival orders the queues (FCFS) and picks the newest to preempt. Intake stamps it
    # from a counter as it accepts each request, so: in the order they are sent, not trace lines.
    arrival_order = itertools.count()
    arrivals = Arrivals(trace, 0.0) if gated else None

    def finished(index: int, replica: str | None) -> None:
        nonlocal num_left
        if replica is not None:
            router.release(replica)
        num_left -= 1
        if arrivals is not None:
            arrivals.finish(index, loop.time())
            release_gated()
        if num_left == 0 and not all_done.done():
            all_done.set_result(None)

    def received(num_tokens: int) -> None:
        if arrivals is not None:
            arrivals.receive(num_tokens, loop.time())
            release_gated()

    def release_gated() -> None:
        now = loop.time()
        for i, at in arrivals.due(now):
            sender.at(max(at, now) + trace[i].after_gate_s, i)

    def send(i: int) -> None:
        r = trace[i]
        now = loop.time()
        timing = timings[i] = RequestTiming(tag=r.tag, arrival=now, num_prompt_tokens=r.prompt_tokens)
        ids = token_ids(r, i)
        hashes = list(prefix_block_hashes(ids, block_size)) if router.policy == "prefix" else []
        name = router.route(hashes, len(ids) / block_size)  # prefix_min_share: as the ingress routes
        replica = replicas[int(name)]
        params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True, priority=r.priority)
        delivery = Delivery(timing, loop.time, received, lambda: finished(i, name))
        req = Request(str(i), ids, params, NullDetokenizer(), None, next(arrival_order), delivery, seed=0,
                      arrival_time=now)  # the scheduler's clock, not the wall's
        why = replica.refusal(req)
        if why is not None:
            timing.ok, timing.error, timing.end = False, f"refused: {why}", now
            finished(i, name)
            return
        routed[int(name)] += 1
        replica.add(req)

    sender = _Sender(loop, send)
    for i, r in enumerate(trace):
        if gated:
            loop.call_at(r.arrival_s, release_gated)
        else:
            sender.at(r.arrival_s, i)
    if not trace:
        all_done.set_result(None)
    tasks = [t for rep in replicas for t in rep.tasks]
    await asyncio.wait([all_done, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        if t.done():  # an actor ended while requests were still in flight: that is a bug, say so
            t.result()
            raise RuntimeError("a simulated actor stopped before the trace was served")
    duration = loop.time()
    for rep in replicas:
        await rep.stop()
    return SimResult(list(timings), duration, 0.0, tally, steps, routed)


BURST_S = 0.001  # a request due this soon after the one before it goes in the same burst
BURST_SPAN_S = 0.005  # ... unless it is due this long after the burst's first (bench bursts span 2-3 ms)


class _Sender:
    """Sends requests at their times, those due at the same time in trace order (the loop's
    timers do not keep the order of equal times), with one timer armed at a time.

    A request due less than BURST_S after the one sent before it goes with it: engine-bench
    stamps the requests it sends in one event-loop turn 30-300 µs apart (the time to build each;
    64 of them span 2-3 ms), and the engine's scheduler sees such a burst whole, in one step;
    sent one by one on the virtual clock, the first ones would get a step of their own. A burst
    spans at most BURST_SPAN_S from its first request: chained gap by gap, 1,000 requests 0.9 ms
    apart went at once, the last sent (and its TTFT counted) 0.9 s before it arrived."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send):
        self.loop, self.send = loop, send
        self.queue: list[tuple[float, int]] = []  # (time, trace index), a heap
        self.timer: asyncio.TimerHandle | None = None

    def at(self, when: float, index: int) -> None:
        heapq.heappush(self.queue, (when, index))
        if self.timer is None or when < self.timer.when():
            self._arm()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(self.queue[0][0], self._fire) if self.queue else None

    def _fire(self) -> None:
        self.timer = None
        now = self.loop.time()
        last = now
        while self.queue and self.queue[0][0] < min(last + BURST_S, now + BURST_SPAN_S):
            when, index = heapq.heappop(self.queue)
            last = max(last, when)
            self.send(index)
        if self.timer is None:
            self._arm()
