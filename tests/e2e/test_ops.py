"""Operator surface of the real server: /metrics, /debug/trace, /debug/state, /health, and a full
queue answering 429 at once. Disconnects are in test_disconnects.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.blas import load_blas
from server.config import ServerConfig
from statemachine.spec import load_policy
from tests.e2e.conftest import SERVE_FLAGS, start_server, stop_server
from tests.lifecycle_names import ADMIT, CHUNK_DONE, DECODING, FINISH, FINISHED, GRANT, WAITING
from tests.server.http_helpers import OpenStream, get, post

# Named in DESIGN.md; the server exports the engine's registry as it is.
METRICS = (
    "fairtick_prefill_chunks", "fairtick_decode_steps", "fairtick_mixed_steps",
    "fairtick_prefill_grants", "fairtick_ticks", "fairtick_time_to_first_token_seconds",
    "fairtick_inter_token_latency_seconds", "fairtick_request_queue_time_seconds",
    "fairtick_parked_wait_ticks", "fairtick_requests_running", "fairtick_requests_waiting",
    "fairtick_requests_parked", "fairtick_prompt_tokens", "fairtick_generation_tokens",
)
TRACE_SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "trace-event.schema.json")
                          .read_text())
LONG = 4000  # max_tokens of a stream that a test cuts off long before it ends


def test_health(server):
    body = get(server.url, "/health").json()
    assert body["status"] == "ok" and body["policy"]


def test_metrics_parse_and_name_every_design_metric(server):
    post(server.url, "/v1/completions", {"prompt": "metrics", "max_tokens": 2})
    reply = get(server.url, "/metrics")
    families = {f.name for f in text_string_to_metric_families(reply.body.decode())}
    missing = [name for name in METRICS if name not in families]
    assert not missing, f"missing from /metrics: {missing}"
    assert server.gauges()["fairtick_generation_tokens_total"] >= 2


def trace_events(server, since: int = 0, **query: object) -> list[dict]:
    args = urllib.parse.urlencode({"since": since, **query})
    text = get(server.url, f"/debug/trace?{args}").body.decode()
    return [json.loads(line) for line in text.splitlines()]


def test_trace_shows_a_requests_whole_lifecycle(server):
    prompt = "x" * 40  # two 32-token chunks
    reply = post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 3}).json()
    events = trace_events(server, request_id=reply["id"])  # the id the client saw
    assert {e["seq"] for e in events} == {events[0]["seq"]}, "one request, one sequence"
    assert events[0]["kind"] == "arrival" and events[0]["to"] == WAITING
    triggers = [e["trigger"] for e in events if e["kind"] == "transition"]
    assert triggers[0] == ADMIT and triggers[-1] == FINISH, triggers
    # At least two chunks (the policy may size them smaller); every grant ends in a chunk_done.
    assert triggers.count(GRANT) >= 2, triggers
    assert triggers.count(GRANT) == triggers.count(CHUNK_DONE), triggers
    assert events[-1]["to"] == FINISHED
    for e in events:
        jsonschema.validate(e, TRACE_SCHEMA)
    ticks = [e["tick"] for e in events]
    assert ticks == sorted(ticks)
    assert trace_events(server, since=ticks[-1])[0]["tick"] == ticks[-1]
    times = [e["t_s"] for e in events]
    assert times == sorted(times)
    assert trace_events(server, since_s=times[-1], request_id=reply["id"]) == \
        [e for e in events if e["t_s"] >= times[-1]]


def test_trace_finds_every_sequence_of_a_batch_by_the_id_the_client_saw(server):
    reply = post(server.url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}).json()
    events = trace_events(server, request_id=reply["id"])
    assert {e["request_id"] for e in events} == {reply["id"]}
    assert len([e for e in events if e["kind"] == "arrival"]) == 2, "one arrival per prompt"
    finished = {e["seq"] for e in events if e["to"] == FINISHED}
    assert len(finished) == 2 and finished == {e["seq"] for e in events}
    assert trace_events(server, request_id=f"{reply['id']}-0") == [], "not an id clients see"


def test_trace_filters_and_refuses_unknown_parameters(server):
    post(server.url, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    every = trace_events(server)
    assert trace_events(server, limit=3) == every[-3:], "limit keeps the latest"
    finished = trace_events(server, state=FINISHED)
    assert finished and all(FINISHED in (e["from"], e["to"]) for e in finished)
    for query, param in (("tick=3", "tick"), ("limit=0", "limit"), ("since_s=-1", "since_s"),
                         ("format=csv", "format")):
        reply = get(server.url, f"/debug/trace?{query}")
        assert reply.status == 400, query
        assert reply.json()["error"]["param"] == param


def test_trace_exports_perfetto(server):
    reply = post(server.url, "/v1/completions", {"prompt": "perfetto", "max_tokens": 2}).json()
    out = get(server.url, "/debug/trace?format=perfetto").json()
    events = out["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(reply["id"] in name for name in names), "a track named by the request id"
    ticks = [e for e in events if e["ph"] == "X" and e.get("cat") == "tick"]
    assert ticks and all(e["pid"] == 2 and e["dur"] >= 0 and e["ts"] >= 0 for e in ticks)
    assert {"batch", "kv_tokens"} <= {e["name"] for e in events if e["ph"] == "C"}


def test_debug_state_names_the_policy_and_its_parameters(server):
    state = get(server.url, "/debug/state").json()
    spec = load_policy("default")  # the server runs with no --policy
    assert (state["policy"], state["params"]) == (spec.name, spec.defaults)
    flags = dict(zip(SERVE_FLAGS[::2], SERVE_FLAGS[1::2], strict=True))
    assert state["max_running"] == int(flags["--max-running"])
    assert state["prefill_chunk_size"] == int(flags["--prefill-chunk-size"])


def test_start_up_objects_are_frozen_out_of_full_collections(server):
    # A full collection walked the ~100,000 objects start-up builds in 70-76 ms, the engine
    # thread stopped all the while; the server freezes them once it has started.
    memory = get(server.url, "/debug/state").json()["memory"]
    assert memory["gc_frozen_objects"] > 10_000, memory
    assert len(memory["gc_collections"]) == 3 and all(n >= 0 for n in memory["gc_collections"])


def test_the_listen_backlog_reaches_the_kernel(server):
    # For a listening socket, `ss` shows its accept-queue limit in Send-Q.
    if shutil.which("ss") is None:
        pytest.skip("needs `ss` (iproute2) to read a socket's listen backlog")
    port = urllib.parse.urlparse(server.url).port
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True,
                         check=True).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(out[2]) == min(ServerConfig().listen_backlog, somaxconn), out


def open_running(server, count: int) -> list[OpenStream]:
    """`count` streams that have each received a token (so each holds a slot). They opt out
    of the prefix cache, so that memory returns to its baseline when they end."""
    streams = [OpenStream(server.url, "/v1/completions",
                          {"prompt": f"s{i}", "max_tokens": LONG, "stream": True,
                           "cache_prompt": False})
               for i in range(count)]
    for stream in streams:
        stream.read_event()
    return streams


def wait_state(server, what, timeout_s: float = 10.0) -> None:
    """Until `what(/debug/state)` holds (fails after a guard time)."""
    deadline = time.monotonic() + timeout_s
    while not what(state := server.state()):
        assert time.monotonic() < deadline, f"condition never held: {state}"
        time.sleep(0.02)


def wait_gauge(server, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.gauges().get(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {server.gauges()}"
        time.sleep(0.05)


def test_the_server_says_which_blas_it_runs_on(server):
    # The server and this test process start from the same environment: the same BLAS.
    ours = load_blas()
    assert f"BLAS: {ours.describe()}" in server.log_path.read_text()
    blas = server.state()["blas"]
    assert blas["setting"] == ours.setting
    assert blas["library"] == (str(ours.library) if ours.library else None)


def test_blas_reference_runs_on_the_bundled_blas(tmp_path):
    served = start_server(tmp_path, "--blas", "reference", *SERVE_FLAGS)
    try:
        assert "BLAS: MLX's own BLAS (the bundled reference BLAS" in served.log_path.read_text()
        assert served.state()["blas"]["library"] is None
        reply = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert reply.status == 200, reply.body
    finally:
        assert stop_server(served) == 0


def test_a_full_queue_answers_429_with_retry_after(server):
    running = open_running(server, 2)
    queued = [OpenStream(server.url, "/v1/completions",
                         {"prompt": f"q{i}", "max_tokens": 4, "stream": True}) for i in range(2)]
    full = sorted([DECODING] * 2 + [WAITING] * 2)
    wait_state(server, lambda s: sorted(q["state"] for q in s["sequences"]) == full)
    reply = post(server.url, "/v1/completions", {"prompt": "one too many", "max_tokens": 2})
    assert reply.status == 429 and int(reply.headers["retry-after"]) >= 1
    assert reply.error()["type"] == "rate_limit_error"
    # Answered at once: the running places and the queue were still full, so it never waited
    # for room.
    state = server.state()
    assert sorted(q["state"] for q in state["sequences"]) == full
    assert state["admission"]["queued"] == 2
    for stream in running + queued:
        stream.drop()
