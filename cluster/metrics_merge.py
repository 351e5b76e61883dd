"""/metrics of a cluster: every replica's Prometheus text in one exposition, each sample
labelled with its replica. Imports no Ray (unit-tested on real engine registries)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Merged:
    # A collector that yields the already merged families (CollectorRegistry wants collectors).
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """One Prometheus text exposition of the replicas' `texts` (by replica id): each family
    once, with every replica's samples labelled `replica="<id>"`."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit))
            merged.samples.extend(
                Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp,
                       s.exemplar) for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry)
