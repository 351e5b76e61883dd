"""The operator's docs hold for the real server, read from its real /metrics:

- docs/operations.md lists every metric the server exports, with its type and labels, and no
  other;
- docs/grafana-dashboard.json is a Grafana dashboard whose every query is PromQL (parsed by a
  real PromQL parser, with Grafana's variables replaced as Grafana replaces them) over series
  the server exports, with labels they carry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.http_helpers import get, post
from tests.server.serving import serve

DOCS = Path(__file__).resolve().parents[2] / "docs"
DASHBOARD = DOCS / "grafana-dashboard.json"
OPERATIONS = DOCS / "operations.md"
# What Grafana puts in place of its variables before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"instance", "job"})
# Grafana's own query for a variable's values: label_values(metric, label).
LABEL_VALUES = re.compile(r"label_values\((?P<metric>\w+),\s*(?P<label>\w+)\)")
# What an operator comes to the dashboard for (issue 14): each must have a panel.
WATCHED = ("fairtick_time_to_first_token_seconds_bucket",
           "fairtick_inter_token_latency_seconds_bucket",
           "fairtick_request_queue_time_seconds_bucket", "fairtick_parked_wait_ticks_bucket",
           "fairtick_ticks_total", "fairtick_kv_used_tokens", "fairtick_kv_budget_tokens",
           "fairtick_requests_finished_total", "fairtick_requests_aborted_total",
           "fairtick_requests_refused_total", "fairtick_e2e_request_latency_seconds_bucket")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


@pytest.fixture(scope="module")
def scraped(bundle) -> tuple[str, str]:
    """The server's /metrics text at its start, and once a request has finished and one was
    refused (so every labelled family has its samples)."""
    with serve(bundle) as served:
        at_start = get(served.url, "/metrics").body.decode()
        assert post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status \
            == 200
        assert post(served.url, "/v1/completions", {"max_tokens": "many"}).status == 400
        served.wait_idle()
        return at_start, get(served.url, "/metrics").body.decode()


@pytest.fixture(scope="module")
def exported(scraped) -> dict[str, set[str]]:
    """Every sample name the server exports, with the label names it carries."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(scraped[1]):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    return exprs + [v["definition"] for v in dashboard["templating"]["list"]
                    if v["type"] == "query"]


def selectors(query: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The metric names a query selects with the labels it matches on, and the labels it
    groups by."""
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    if match := LABEL_VALUES.fullmatch(query):
        return [(match["metric"], set())], {match["label"]}
    chosen: list[tuple[str, set[str]]] = []
    grouped: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {query!r}"
            chosen.append((node.name, {m.name for m in node.matchers.matchers}))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouped.update(node.modifier.labels)

    promql_parser.walk(promql_parser.parse(query), visit)
    return chosen, grouped


def test_the_dashboard_is_a_grafana_dashboard(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, panel["title"]
        mine = {(box["x"] + dx, box["y"] + dy) for dx in range(box["w"]) for dy in range(box["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels(dashboard):
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_every_query_parses_and_selects_only_exported_series(dashboard, exported):
    for query in queries(dashboard):
        chosen, grouped = selectors(query)
        assert chosen, f"{query!r} selects nothing"
        carried = set(TARGET_LABELS)
        for name, matched in chosen:
            assert name in exported, f"{query!r}: the server exports no {name}"
            assert matched <= exported[name] | TARGET_LABELS, \
                f"{query!r}: {name} has no label {sorted(matched - exported[name])}"
            carried |= exported[name]
        assert grouped <= carried, f"{query!r} groups by labels no series has: {grouped}"


def test_a_quantiles_legend_names_its_quantile(dashboard):
    # "p100" labelled histogram_quantile(0.999, ...): an operator read p99.9 as the maximum.
    named = 0
    for panel in panels(dashboard):
        for target in panel["targets"]:
            found = re.match(r"\s*histogram_quantile\(\s*([0-9.]+)\s*,", target["expr"])
            legend = target.get("legendFormat", "")
            if found and re.fullmatch(r"p[0-9.]+", legend):
                assert legend == f"p{float(found.group(1)) * 100:g}", (panel["title"], legend)
                named += 1
    assert named >= 3  # the latency panels' p50 ... p99.9


def test_the_dashboard_shows_what_an_operator_watches(dashboard):
    shown = {name for query in queries(dashboard) for name, _ in selectors(query)[0]}
    assert set(WATCHED) <= shown, sorted(set(WATCHED) - shown)


def test_a_query_over_a_name_the_server_lacks_is_caught(exported):
    # The check above can fail: a renamed metric is not exported.
    [(name, _)], _ = selectors('rate(fairtick_kv_tokens{instance=~"$instance"}[$__rate_interval])')
    assert name == "fairtick_kv_tokens" and name not in exported
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (le (rate(x[1m]))")


# --- docs/operations.md ------------------------------------------------------------------------

def documented() -> dict[str, tuple[str, dict[str, set[str]]]]:
    """The metrics table of docs/operations.md: name -> (type, {label: the values listed})."""
    rows = [line for line in OPERATIONS.read_text().splitlines()
            if line.startswith("| `fairtick_")]
    table = {}
    for row in rows:
        name, kind, _unit, labels, _meaning = (c.strip() for c in row.strip("|").split("|"))
        listed = {m["label"]: set(re.findall(r"`(\w+)`", m["values"] or ""))
                  for m in re.finditer(r"`(?P<label>\w+)`(?: \((?P<values>[^)]*)\))?", labels)}
        table[name.strip("`")] = (kind, listed)
    return table


def test_the_operator_docs_list_every_exported_metric_and_no_other(scraped):
    at_start, after = (list(text_string_to_metric_families(t)) for t in scraped)
    created = {f.name for f in after if f.name.endswith("_created") and f.type == "gauge"}
    families = {}
    for family in after:
        if family.name in created:  # prometheus-client's creation time of each counter/histogram
            continue
        name = f"{family.name}_total" if family.type == "counter" else family.name
        families[name] = (family.type, {k for s in family.samples for k in s.labels} - {"le"})
    table = documented()
    assert set(table) == set(families), (sorted(set(families) - set(table)),
                                        sorted(set(table) - set(families)))
    for name, (kind, labels) in families.items():
        assert (table[name][0], set(table[name][1])) == (kind, labels), name
    # Label values the docs list are the ones exported from the start.
    for family in at_start:
        name = f"{family.name}_total" if family.type == "counter" else family.name
        for label, values in table.get(name, ("", {}))[1].items():
            if values:
                assert values == {s.labels[label] for s in family.samples}, (name, label)
    assert {f"{name.removesuffix('_total')}_created" for name, (kind, _) in families.items()
            if kind in ("counter", "histogram")} == created
