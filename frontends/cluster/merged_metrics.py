"""/metrics of the ingress: every replica's Prometheus text, merged, with a `replica` label.

Each replica renders its own registry (vLLM's names, as `engine-serve`); here each sample
gets `replica="replica-N"` and families of the same name are joined, so one scrape sees the
whole cluster and `sum without (replica)` gives the totals. The ingress adds its own view:
`stepwise:replica_up` (1 while the router sends it traffic) and `stepwise:replica_in_flight`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(texts: Mapping[str, bytes], up: Mapping[str, bool], in_flight: Mapping[str, int]) -> bytes:
    """`texts`: replica name -> its /metrics text (replicas that did not answer are left out)."""
    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text.decode()):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                for s in family.samples)
    for name, doc, values in [
        ("stepwise:replica_up", "1 while the router sends this replica requests.", {r: float(v) for r, v in up.items()}),
        ("stepwise:replica_in_flight", "Requests the ingress has in flight on this replica.", in_flight),
    ]:
        family = merged[name] = Metric(name, doc, "gauge")
        family.samples.extend(Sample(name, {"replica": r}, float(v), None, None) for r, v in values.items())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
