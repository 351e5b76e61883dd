"""scripts/reliability.py, small: every phase against a real `fairtick serve` (4 running, a queue
of 8, 32-token chunks), and the script's own judgement of streams and answers."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import LiveServer, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "reliability.py"
FLAGS = ("--max-running", "4", "--max-waiting", "8", "--prefill-chunk-size", "32")
SMALL = ["--load-streams", "24", "--load-tokens", "16", "--storm-streams", "60",
         "--storm-tokens", "16", "--fuzz-examples", "150", "--fuzz-bodies", "100",
         "--timeout-s", "60"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("reliability"), *FLAGS)
    yield server
    assert stop_server(server) == 0, server.log()


def run(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


def rows(report: list[dict], phase: str) -> dict[str, str]:
    [entry] = [r for r in report if r["phase"] == phase]
    assert entry["failures"] == [], entry
    return dict(entry["rows"])


def test_every_phase_passes_against_the_real_server(served, tmp_path):
    out = tmp_path / "report.json"
    result = run("--url", served.url, "--pid", str(served.process.pid), "--json-out", str(out),
                 *SMALL)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for phase in ("load", "disconnect storm", "fuzz", "bodies", "overload"):
        assert f"## {phase}" in result.stdout
    assert result.stdout.rstrip().endswith("all phases passed")
    report = json.loads(out.read_text())

    load = rows(report, "load")
    assert load["streams exact"] == "24/24" and load["tokens received"] == str(24 * 16)
    assert (load["lost"], load["duplicated"]) == ("0", "0")

    storm = rows(report, "disconnect storm")
    assert storm["normal request after the storm"] == "exact"
    assert all(storm[f"after: {name}"] in ("0", "0.0") for name in (
        "fairtick_requests_running", "fairtick_requests_waiting", "live sequences",
        "KV tokens cached", "cached sequences"))
    assert "MiB" in storm["server RSS start -> end"]

    fuzz = rows(report, "fuzz")
    answered = {k: int(v) for k, v in fuzz.items() if k.startswith("answered: ")}
    assert set(answered) <= {"answered: 2xx", "answered: 4xx JSON"}
    assert sum(answered.values()) >= 150 and fuzz["health after"] == "ok"

    bodies = rows(report, "bodies")
    assert bodies["bodies sent"] == "100" and bodies["health after"] == "ok"
    assert (bodies["5xx"], bodies["dropped connections"]) == ("0", "0")
    statuses = ast.literal_eval(bodies["statuses"])  # {"200": n, "400": m, ...}
    assert sum(statuses.values()) == 100 and all(s[0] in "24" for s in statuses)
    assert statuses.get("200", 0) >= 1 and statuses.get("400", 0) >= 1, "both kinds generated"

    overload = rows(report, "overload")
    total = int(overload["simultaneous requests"])
    state = served.state()  # what the server holds at once: running and its waiting queue
    capacity = state["max_running"] + state["admission"]["max_waiting"]
    assert int(overload["max_running + max_waiting"]) == capacity
    assert total > capacity, "the phase must send more than the server can hold"
    assert int(overload["answered: completed"]) >= 1
    assert int(overload["answered: 429 with Retry-After"]) >= 1
    assert int(overload["answered: completed"]) + int(
        overload["answered: 429 with Retry-After"]) == total


def test_an_unreachable_server_is_exit_2():
    result = run("--url", "http://127.0.0.1:9", "--timeout-s", "5", timeout_s=60)
    assert result.returncode == 2 and "cannot use the server" in result.stderr


def test_an_unknown_phase_is_exit_2():
    result = run("--phases", "load,nap", timeout_s=60)
    assert result.returncode == 2 and "nap" in result.stderr


# --- the script's judgement, on answers a broken server would give ----------------------------

@pytest.fixture(scope="module")
def reliability():
    import reliability as module  # scripts/ is on sys.path (tests/conftest.py)
    return module


def exact_stream(reliability, text: str = "abcd"):
    out = reliability.Stream(status=200, pieces=list(text), finish=["length"], done=True,
                             usage={"prompt_tokens": 3, "completion_tokens": len(text),
                                    "total_tokens": 3 + len(text),
                                    "prompt_tokens_details": {"cached_tokens": 2}},
                             ids={"cmpl-1"})
    return out, reliability.Reference("p", text, 3)


def test_a_stream_is_exact_only_with_every_token_once(reliability):
    out, ref = exact_stream(reliability)
    assert reliability.problems(out, ref, 4) == []
    out.pieces = ["a", "b", "d"]  # one lost
    assert "text differs" in reliability.problems(out, ref, 4)
    out.pieces = ["a", "b", "b", "c", "d"]  # one duplicated
    assert "text differs" in reliability.problems(out, ref, 4)
    out, ref = exact_stream(reliability)
    out.done = False
    assert reliability.problems(out, ref, 4) == ["no [DONE]"]
    out, ref = exact_stream(reliability)
    out.usage = {**out.usage, "completion_tokens": 5}
    assert reliability.problems(out, ref, 4) == ["usage"]
    out, ref = exact_stream(reliability)
    out.usage = {**out.usage, "prompt_tokens_details": {"cached_tokens": 3}}  # all 3 cached
    assert reliability.problems(out, ref, 4) == ["usage"]
    assert reliability.problems(reliability.Stream(failure="reset"), ref, 4) == ["reset"]


def test_answers_are_classified(reliability):
    reply = reliability.Reply
    error = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": None}})
    assert reliability.classify(reply(400, {}, error.encode())) == "4xx JSON"
    assert reliability.classify(reply(400, {}, b"<html>bad</html>")) == "4xx not JSON"
    assert reliability.classify(reply(500, {}, error.encode())) == "5xx"
    assert reliability.classify(reply(200, {"content-type": "text/event-stream"},
                                      b"data: {}\n\n")) == "2xx malformed stream"
    assert reliability.failure_kind(TimeoutError()) == "hang"
    assert reliability.failure_kind(ConnectionResetError()) == "reset"
