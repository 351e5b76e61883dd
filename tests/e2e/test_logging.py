"""What `fairtick serve` logs, read from the real process's stderr: its start-up progress, one
line per request the engine lets go, the access log when asked for, and the level set by
`--log-level` or FAIRTICK_LOG_LEVEL."""

from __future__ import annotations

import re
import time
import urllib.parse

from server.logs import LOG_LEVEL_ENV
from tests.e2e.conftest import SERVE_FLAGS, start_server, stop_server
from tests.server.http_helpers import OpenStream, get, post

# Start-up progress, in the order start-up reaches it (the line's text after `name: `).
START_UP = (
    ("blas", r"fairtick\.server: BLAS: .+"),
    ("softmax", r"fairtick\.server: attention softmax: (fast \(compiled exp.+\)|MLX's \(.+\))"),
    ("kernel", r"fairtick\.server: native kernels: (fairtick's, .+|MLX's ops \(.+\))"),
    ("loading", r"fairtick\.server: loading the built-in model"),
    ("model", r"fairtick\.server: model (?P<name>\S+) loaded from \S+ in (?P<s>\d+\.\d+) s "
              r"\(context (?P<context>\d+) tokens\)"),
    ("engine", r"fairtick\.server: engine built in \d+\.\d+ s"),
    ("kv", r"fairtick\.server: KV budget: (?P<tokens>[\d,]+) tokens \(.+\); up to "
           r"(?P<running>\d+) sequences running"),
    ("policy", r"fairtick\.server: serving (?P<name>\S+) with policy (?P<policy>\w+) "
               r"\((?P<params>.+)\)"),
    ("listen", r"fairtick\.server: listening on http://(?P<host>[\d.]+):(?P<port>\d+)"),
)
LINE_HEAD = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) "


def log_matches(text: str, pattern: str) -> list[re.Match[str]]:
    return list(re.finditer(LINE_HEAD + pattern + "$", text, re.MULTILINE))


def wait_log(server, pattern: str, timeout_s: float = 15.0) -> re.Match[str]:
    """The one line of the server's log that matches `pattern`, once it is written."""
    deadline = time.monotonic() + timeout_s
    while not (found := log_matches(server.log_path.read_text(), pattern)):
        assert time.monotonic() < deadline, f"no line {pattern!r} in:\n{server.log()}"
        time.sleep(0.05)
    assert len(found) == 1, [m.group(0) for m in found]
    return found[0]


def request_fields(server, request_id: str) -> dict[str, str]:
    line = wait_log(server, rf"fairtick\.requests: request {request_id} (?P<rest>.+)")
    assert line["level"] == "INFO"
    outcome, _, fields = line["rest"].partition(": ")
    return {"outcome": outcome, **dict(f.split("=", 1) for f in fields.split())}


def test_start_up_logs_each_step_with_its_numbers(server, model_name):
    # The address is logged once the server listens, which may come after /health answered.
    found = {step: wait_log(server, pattern) for step, pattern in START_UP}
    assert {match["level"] for match in found.values()} == {"INFO"}
    assert [found[step].start() for step, _ in START_UP] == sorted(
        found[step].start() for step, _ in START_UP), "in start-up order"
    state = server.state()
    assert found["model"]["name"] == found["policy"]["name"] == model_name
    assert int(found["model"]["context"]) > 0 and float(found["model"]["s"]) >= 0
    assert int(found["kv"]["tokens"].replace(",", "")) == state["kv"]["budget_tokens"]
    assert int(found["kv"]["running"]) == state["max_running"]
    assert found["policy"]["policy"] == state["policy"]
    params = dict(p.split("=") for p in found["policy"]["params"].split())
    assert {k: float(v) for k, v in params.items()} == state["params"]
    port = urllib.parse.urlparse(server.url).port
    assert (found["listen"]["host"], int(found["listen"]["port"])) == ("127.0.0.1", port)


def test_each_request_logs_one_line_and_no_access_log_by_default(server):
    reply = post(server.url, "/v1/completions", {"prompt": "log", "max_tokens": 3}).json()
    fields = request_fields(server, reply["id"])
    assert fields["outcome"] == "finished"
    assert (fields["finish_reason"], int(fields["completion_tokens"])) == ("length", 3)
    assert int(fields["prompt_tokens"]) == reply["usage"]["prompt_tokens"]
    assert 0 <= float(fields["queue_s"]) <= float(fields["ttft_s"]) <= float(fields["e2e_s"])
    stream = OpenStream(server.url, "/v1/completions",
                        {"prompt": "gone", "max_tokens": 4000, "stream": True})
    stream.read_event()
    stream.drop()
    fields = request_fields(server, stream.request_id)
    assert (fields["outcome"], fields["cause"]) == ("aborted", "client_disconnect")
    assert "sanic.access" not in server.log_path.read_text()


def test_a_batch_of_choices_logs_one_line_under_the_id_the_client_saw(server):
    reply = post(server.url, "/v1/completions",
                 {"prompt": ["one", "two"], "n": 2, "max_tokens": 2}).json()
    fields = request_fields(server, reply["id"])
    assert (fields["outcome"], fields["finish_reason"]) == ("finished", "length")
    assert int(fields["prompt_tokens"]) == reply["usage"]["prompt_tokens"]
    assert int(fields["completion_tokens"]) == reply["usage"]["completion_tokens"] == 2 * 2 * 2
    server.wait_idle()
    mine = log_matches(server.log_path.read_text(), rf"fairtick\.requests: request "
                       rf"{reply['id']}\S* .+")
    assert len(mine) == 1, [m.group(0) for m in mine]


def test_the_access_log_and_the_level_flag_over_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    served = start_server(tmp_path, "--access-log", "--log-level", "info", *SERVE_FLAGS)
    try:
        reply = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert reply.status == 200
        assert get(served.url, "/nope").status == 404
        request_fields(served, reply.json()["id"])
        line = wait_log(served, r'sanic\.access: 127\.0\.0\.1:\d+ "POST \S+/v1/completions" '
                                r"200 (?P<bytes>\d+) (?P<ms>[\d.]+)ms")
        assert int(line["bytes"]) == len(reply.body) and line["level"] == "INFO"
        wait_log(served, r'sanic\.access: 127\.0\.0\.1:\d+ "GET \S+/nope" 404 \d+ [\d.]+ms')
    finally:
        assert stop_server(served) == 0


def test_the_variable_sets_the_level(tmp_path, monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    served = start_server(tmp_path, "--access-log", *SERVE_FLAGS)
    try:
        reply = post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert reply.status == 200
    finally:
        assert stop_server(served) == 0
    text = served.log_path.read_text()
    assert "/health" not in text and reply.json()["id"] not in text, text
    below = [m.group(0) for m in log_matches(text, r".*") if m["level"] in ("DEBUG", "INFO")]
    assert not below, f"lines below warning:\n{text}"
