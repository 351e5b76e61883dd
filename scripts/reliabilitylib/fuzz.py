"""The fuzz phases: Hypothesis sends generated requests (`fuzz`: reliabilitylib.cases; `bodies`:
reliabilitylib.bodies); every answer must be a 2xx or an OpenAI-style JSON 4xx, never a 5xx,
reset or hang, and /health stays ok."""

from __future__ import annotations

import argparse
import http.client
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from benchlib.client import Reply
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from reliabilitylib.bodies import CHAT, COMPLETIONS, FuzzedBody, fuzzed_bodies, top_level
from reliabilitylib.cases import Case, field_cases, raw_cases
from reliabilitylib.report import PhaseResult
from reliabilitylib.schema_bodies import schema_bodies
from reliabilitylib.target import Target, failure_kind, health_ok, is_json_error, wait_drained


def classify(reply: Reply) -> str:
    """The class of an answer: 2xx, 4xx JSON, or what is wrong with it."""
    if 200 <= reply.status < 300:
        text = reply.body.decode(errors="replace")
        if reply.headers.get("content-type", "").startswith("text/event-stream"):
            return "2xx" if text.rstrip().endswith("data: [DONE]") else "2xx malformed stream"
        return "2xx" if "choices" in json.loads(text) else "2xx malformed body"
    if 400 <= reply.status < 500:
        return "4xx JSON" if is_json_error(reply) else "4xx not JSON"
    return f"{reply.status // 100}xx"


def send_case(t: Target, case: Case) -> str:
    """The class of the server's answer to `case`; a field case's 400 or 404 must name a field
    it changed (its base body is valid; a batch of prompts past the queue is a 429)."""
    try:
        reply = t.exchange(case.method, case.path, raw=case.body,
                           content_type=case.content_type, chunked=case.chunked)
    except (OSError, http.client.HTTPException) as exc:
        return failure_kind(exc)
    kind = classify(reply)
    if kind == "4xx JSON" and reply.status in (400, 404) and " fields: " in case.label:
        changed = {name.lstrip("-") for name in case.label.split(": ")[1].split(",")}
        param = str(reply.json()["error"]["param"]).split("[")[0].split(".")[0]
        if param not in changed:
            return "4xx not naming a changed field"
    return kind


@dataclass(frozen=True)
class Aftermath:
    """How a generated run went for the server: its wall time, the health checks that failed
    during it, and whether it was healthy and idle afterwards."""

    wall_s: float
    failed_checks: int
    healthy_after: bool
    left: dict[str, float]

    def rows(self) -> list[tuple[str, object]]:
        return [("wall", f"{self.wall_s:.1f} s"), ("health checks failed", self.failed_checks),
                ("health after", "ok" if self.healthy_after else "NOT OK"),
                ("after: anything held", dict(self.left) if any(self.left.values())
                 else "nothing")]

    def failures(self) -> list[str]:
        if self.failed_checks or not self.healthy_after or any(self.left.values()):
            return ["the server was unhealthy or held work afterwards"]
        return []


def probe_run(t: Target, probe: Callable[[], None], unhealthy: list[int]) -> Aftermath:
    """Run the Hypothesis `probe` (which appends to `unhealthy`), then wait for the server to
    drain and check its health."""
    started = time.monotonic()
    probe()
    wall = time.monotonic() - started
    left = wait_drained(t, 30)
    return Aftermath(wall, len(unhealthy), health_ok(t), left)


def run_fuzz(t: Target, args: argparse.Namespace) -> PhaseResult:
    """`args.fuzz_examples` generated requests (seeded), health checked every 25."""
    seen: list[tuple[str, Case]] = []
    unhealthy: list[int] = []
    oversize = Case("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
                    "application/json", "oversize: 5 MiB")

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.fuzz_examples, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False)
    @given(case=st.one_of(field_cases(t.context_length), raw_cases()))
    @example(case=oversize)
    @example(case=Case("/v1/completions", b"{}", None, "content type: none, {}"))
    def probe(case: Case) -> None:
        seen.append((send_case(t, case), case))
        if len(seen) % 25 == 0 and not health_ok(t):
            unhealthy.append(len(seen))

    after = probe_run(t, probe, unhealthy)
    kinds = Counter(kind for kind, _ in seen)
    labels = Counter(case.label.split(":")[0] for _, case in seen)
    bad = [(kind, case) for kind, case in seen if kind not in ("2xx", "4xx JSON")]
    rows: list[tuple[str, object]] = [("requests", len(seen))]
    rows += [(f"answered: {kind}", count) for kind, count in sorted(kinds.items())]
    rows += [("generated kinds", dict(labels.most_common())), *after.rows()]
    for kind, case in bad[:5]:
        rows.append((f"example {kind}", f"{case.label}: {case.path} {case.body[:120]!r}"))
    failures = []
    if bad:
        kinds_bad = dict(Counter(kind for kind, _ in bad))
        failures.append(f"{len(bad)} answers neither 2xx nor JSON 4xx: {kinds_bad}")
    return PhaseResult("fuzz", rows, failures + after.failures())


def judge_body(t: Target, case: FuzzedBody) -> tuple[str, str]:
    """(the HTTP status or how the connection failed, the class of the answer); a 400 or 404
    must name a field the case may name (`FuzzedBody.fields`)."""
    try:
        reply = t.exchange("POST", case.path, raw=case.encoded(), content_type="application/json")
    except (OSError, http.client.HTTPException) as exc:
        return failure_kind(exc), "dropped connection"
    if case.path not in (CHAT, COMPLETIONS) and 200 <= reply.status < 300:
        answer = "tokens" if case.path == "/tokenize" else "prompt"
        return str(reply.status), "2xx" if answer in reply.json() else "2xx malformed body"
    kind = classify(reply)
    if kind == "4xx JSON" and reply.status in (400, 404):
        param = reply.json()["error"]["param"]
        if param is None or top_level(str(param)) not in case.fields:
            kind = "4xx not naming a changed field"
    return str(reply.status), kind


def run_bodies(t: Target, args: argparse.Namespace) -> PhaseResult:
    """`args.fuzz_bodies` bodies, one connection each, seeded: half of OpenAI's documented shapes
    with wrong values anywhere in them (reliabilitylib.bodies), half drawn from the body models'
    JSON schemas and changed the same way or not at all, for the generation endpoints, /tokenize
    and /detokenize (reliabilitylib.schema_bodies); health checked every 50."""
    seen: list[tuple[str, str, FuzzedBody]] = []
    unhealthy: list[int] = []

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.fuzz_bodies, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(fuzzed_bodies(t.context_length), schema_bodies(t.context_length)))
    def probe(case: FuzzedBody) -> None:
        seen.append((*judge_body(t, case), case))
        if len(seen) % 50 == 0 and not health_ok(t):
            unhealthy.append(len(seen))

    after = probe_run(t, probe, unhealthy)
    statuses = Counter(status for status, _, _ in seen)
    bad = [(kind, case) for _, kind, case in seen if kind not in ("2xx", "4xx JSON")]
    rows: list[tuple[str, object]] = [
        ("bodies sent", len(seen)),
        ("statuses", dict(sorted(statuses.items()))),
        ("5xx", sum(n for s, n in statuses.items() if s.startswith("5"))),
        ("dropped connections", sum(1 for _, kind, _ in seen if kind == "dropped connection")),
        ("documented shapes / from the schemas",
         f"{sum(c.base_accepted for _, _, c in seen)} / "
         f"{sum(not c.base_accepted for _, _, c in seen)}"),
        ("per endpoint", dict(Counter(c.path for _, _, c in seen).most_common())),
        *after.rows()]
    rows += [(f"example {kind}", f"{case.path} changed {case.changed}: {case.encoded()[:160]!r}")
             for kind, case in bad[:5]]
    failures = []
    if bad:
        failures.append(f"{len(bad)} answers neither 2xx nor a JSON 4xx naming a changed "
                        f"field: {dict(Counter(kind for kind, _ in bad))}")
    return PhaseResult("bodies", rows, failures + after.failures())
