"""Read what the real server says about its requests: its /metrics samples (parsed with
prometheus_client's own parser) and its per-request log lines (runtime.outcomes)."""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.server.http_helpers import get

FINISHED = "fairtick_requests_finished_total"
ABORTED = "fairtick_requests_aborted_total"
REFUSED = "fairtick_requests_refused_total"
OUTCOMES = (FINISHED, ABORTED, REFUSED)

Series = tuple[str, tuple[tuple[str, str], ...]]
_LINE = re.compile(r"request (?P<id>\S+) (?P<outcome>finished|aborted):(?P<fields>( \w+=\S+)+)$")


def series(name: str, **labels: str) -> Series:
    return name, tuple(sorted(labels.items()))


def parse_samples(text: str) -> dict[Series, float]:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[Series, float]:
    reply = get(url, "/metrics")
    assert reply.status == 200, reply.body
    return parse_samples(reply.body.decode())


def outcome_moves(before: dict[Series, float], after: dict[Series, float]) -> dict[Series, float]:
    """The outcome series that changed, with how much."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()
            if key[0] in OUTCOMES and value != before.get(key, 0.0)}


def wait_moves(url: str, before: dict[Series, float], expected: dict[Series, float],
               timeout_s: float = 15.0) -> dict[Series, float]:
    """Until the outcome series moved by exactly `expected` since `before` (the engine counts a
    request as it lets it go, which may come after its client has the answer); the samples then.
    Fails the test with the moves seen if they never match."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(url)
        moves = outcome_moves(before, after)
        if moves == expected:
            return after
        assert time.monotonic() < deadline, f"outcome series moved by {moves}, not {expected}"
        time.sleep(0.02)


def request_lines(caplog: Any, request_id: str) -> list[dict[str, str]]:
    """The per-request log lines of `request_id`, each as its fields plus `outcome`."""
    found = []
    for record in caplog.records:
        match = _LINE.match(record.getMessage())
        if record.name == "fairtick.requests" and match and match["id"] == request_id:
            fields = dict(part.split("=", 1) for part in match["fields"].split())
            found.append({"outcome": match["outcome"], **fields})
    return found


def wait_line(caplog: Any, request_id: str, timeout_s: float = 15.0) -> dict[str, str]:
    """The one log line of `request_id`, once the engine has written it."""
    deadline = time.monotonic() + timeout_s
    while not (lines := request_lines(caplog, request_id)):
        assert time.monotonic() < deadline, f"no log line for {request_id}"
        time.sleep(0.02)
    assert len(lines) == 1, lines
    return lines[0]
