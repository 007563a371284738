"""Prometheus metrics with vLLM's names, in a registry owned by one app (never the global
one: several servers can live in one process).

Counters and histograms are fed from StepRecords (`observe`, called by the step feed);
queue gauges and KV usage are read from `engine.snapshot()` when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import Engine, StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FINISH_REASONS = ("stop", "length", "abort", "error")  # request_success's series, there from the start


class SnapshotGauges(Collector):
    """Gauges computed at scrape time from the engine's snapshot (zero until it is ready)."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    GAUGES = [
        ("vllm:num_requests_running", "Requests in the running batch."),
        ("vllm:num_requests_waiting", "Requests waiting to be scheduled (or for their grammar)."),
        ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)."),
    ]

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The families without values: registering does not read the engine."""
        for name, doc in self.GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["model_name"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.engine.snapshot() if self.engine.ready else None
        values = [0, 0, 0.0]
        if snap is not None:  # as max_waiting counts them: those arriving during a step (a long one would
            # freeze the count) and those waiting for their grammar count as waiting
            waiting = len(snap.waiting) + snap.num_arriving + snap.num_waiting_for_grammar
            values = [len(snap.running), waiting, snap.kv_usage]
        for (name, doc), value in zip(self.GAUGES, values, strict=True):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge


class Metrics:
    def __init__(self, engine: Engine, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens, counted when prefilled.", m, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.", m,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per finished request.", m, buckets=TOKEN_BUCKETS,
                                                   registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", m,
                                    buckets=E2E_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.", m,
                                      buckets=E2E_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First token to the end.", m,
                                     buckets=E2E_BUCKETS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       m + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM's: rate() sees the first one
            self.request_success.labels(model_name, reason)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute).", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between consecutive tokens.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to final output.", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Prompt + generation tokens per step.", m,
                                          buckets=TOKEN_BUCKETS, registry=r)
        self.steps = Counter("stepwise:steps", "Engine steps by policy.", ["policy"], registry=r)
        self.step_tokens = Counter("stepwise:step_tokens", "Tokens computed per step by policy and kind "
                                   "(prefill, decode, padding, cached).", ["policy", "kind"], registry=r)
        self.step_duration = Histogram("stepwise:step_duration_seconds", "Step time in the executor (batch "
                                       "building, forward, sampling) by policy.", ["policy"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.step_errors = Counter("stepwise:step_errors", "Failed steps by policy.", ["policy"], registry=r)
        r.register(SnapshotGauges(engine, model_name))
        self._last_preemptions = 0

    def observe(self, rec: StepRecord) -> None:
        name, policy = self.model_name, rec.policy
        for f in rec.finished:
            self.request_success.labels(name, f.finish_reason).inc()
            self.e2e.labels(name).observe(f.e2e_s)
            self.request_generation_tokens.labels(name).observe(f.num_generated_tokens)
            # a phase is observed once reached (an abort while waiting has no prefill of 0 s),
            # a prompt once prefilled (as prompt_tokens_total counts it), for each choice (vLLM's)
            for histogram, seconds in ((self.queue_time, f.queue_s), (self.prefill_time, f.prefill_s),
                                       (self.decode_time, f.decode_s)):
                if seconds is not None:
                    histogram.labels(name).observe(seconds)
            if f.prefill_s is not None:
                self.request_prompt_tokens.labels(name).observe(f.num_prompt_tokens)
        if rec.is_idle:
            return
        self.steps.labels(policy).inc()
        self.step_duration.labels(policy).observe(rec.duration_s)
        for kind, n in [("prefill", rec.num_prefill_tokens), ("decode", rec.num_decode_tokens),
                        ("padding", rec.num_padding_tokens), ("cached", rec.num_cached_tokens)]:
            self.step_tokens.labels(policy, kind).inc(n)
        if rec.error is not None:
            self.step_errors.labels(policy).inc()
        self.prompt_tokens.labels(name).inc(rec.num_prompt_tokens)
        self.prefix_queries.labels(name).inc(rec.num_prefix_queries)
        self.prefix_hits.labels(name).inc(rec.num_prefix_hits)
        self.iteration_tokens.labels(name).observe(rec.num_prefill_tokens + rec.num_decode_tokens)
        self.generation_tokens.labels(name).inc(len(rec.ttft_s) + len(rec.itl_s))  # one per sampled token
        for t in rec.ttft_s:
            self.ttft.labels(name).observe(t)
        for t in rec.itl_s:
            self.itl.labels(name).observe(t)
        if rec.num_preemptions > self._last_preemptions:
            self.preemptions.labels(name).inc(rec.num_preemptions - self._last_preemptions)
        self._last_preemptions = rec.num_preemptions

    def render(self) -> bytes:
        return generate_latest(self.registry)
