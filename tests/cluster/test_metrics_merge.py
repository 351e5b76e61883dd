"""/metrics of a cluster: the replicas' real registries merged, each sample labelled by its
replica (cluster.metrics_merge; no Ray needed)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics_merge import REPLICA_LABEL, merge_metrics
from runtime.metrics import EngineMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_sample_of_every_replica_is_kept_under_its_replica_label():
    a, b = EngineMetrics(), EngineMetrics()
    a.ticks.labels("decode").inc(3)
    a.kv_used.set(120)
    b.ttft.observe(0.2)
    b.requests_finished.labels("stop").inc()
    texts = {"r1": generate_latest(a.registry).decode(), "r2": generate_latest(b.registry).decode()}
    merged = merge_metrics(texts).decode()
    got = _samples(merged)
    want = {}
    for replica, text in texts.items():
        for (name, labels), value in _samples(text).items():
            want[(name, tuple(sorted((*labels, (REPLICA_LABEL, replica)))))] = value
    assert got == want
    families = [f.name for f in text_string_to_metric_families(merged)]
    assert len(families) == len(set(families)), "a family must appear once"
    assert got[("fairtick_ticks_total", (("action", "decode"), (REPLICA_LABEL, "r1")))] == 3
    assert got[("fairtick_ticks_total", (("action", "decode"), (REPLICA_LABEL, "r2")))] == 0
