"""`fairtick trace --request ID` and `--perfetto FILE` against a real server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from server.cli import main as fairtick
from tests.server.http_helpers import post


def test_the_story_of_one_request(mixed_server, capsys):
    reply = post(mixed_server.url, "/v1/completions", {"prompt": "s" * 40, "max_tokens": 3})
    rid = reply.json()["id"]
    assert fairtick(["trace", "--url", mixed_server.url, "--request", rid]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"request {rid} (seq ")
    assert [line.split("s  ")[1].split(":")[0] for line in lines[1:-1]] == \
        ["queued", "prefill", "decode"]
    assert "first token at" in lines[-1] and "finished" in lines[-1]
    assert fairtick(["trace", "--url", mixed_server.url, "--request", "cmpl-nobody"]) == 0
    assert "no events in the trace" in capsys.readouterr().out


def test_the_story_of_a_batch_by_the_id_the_client_saw(mixed_server, capsys):
    reply = post(mixed_server.url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    rid = reply.json()["id"]
    assert fairtick(["trace", "--url", mixed_server.url, "--request", rid]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if line.startswith(f"request {rid} (seq ")]
    assert len(heads) == 2, lines  # one story per prompt's sequence
    assert len([line for line in lines if "finished" in line]) == 2, lines


def test_perfetto_file_from_a_server_and_from_json_lines(mixed_server, tmp_path, capsys):
    rid = post(mixed_server.url, "/v1/completions",
               {"prompt": "perfetto", "max_tokens": 2}).json()["id"]
    out = tmp_path / "trace.json"
    assert fairtick(["trace", "--url", mixed_server.url, "--perfetto", str(out)]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    served = json.loads(out.read_text())
    assert any(e["ph"] == "X" and e.get("cat") == "tick" for e in served["traceEvents"])
    # From a file of JSON lines: the same sequence tracks (no ticks: the file has none).
    lines = tmp_path / "trace.jsonl"
    assert fairtick(["trace", "--url", mixed_server.url, "--json"]) == 0
    lines.write_text(capsys.readouterr().out)
    converted = tmp_path / "converted.json"
    assert fairtick(["trace", "--file", str(lines), "--perfetto", str(converted)]) == 0
    tracks = {e["args"]["name"] for e in json.loads(converted.read_text())["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(name.endswith(rid) for name in tracks)


def test_a_reader_that_goes_away_ends_it_quietly(mixed_server, tmp_path, capsys):
    # `fairtick trace --file F | head -1`: more output than a pipe holds, its reader gone after
    # one line. The command stops with SIGPIPE's status and no traceback.
    post(mixed_server.url, "/v1/completions", {"prompt": "pipe", "max_tokens": 2})
    assert fairtick(["trace", "--url", mixed_server.url, "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    span = max(e["tick"] for e in events) + 1
    # The same events again and again, later each time (one trace: its ticks never go back).
    copies = [{**e, "tick": e["tick"] + k * span} for k in range(400) for e in events]
    lines = tmp_path / "trace.jsonl"
    lines.write_text("".join(json.dumps(e) + "\n" for e in copies))  # > 64 KiB of table
    command = [str(Path(sys.executable).parent / "fairtick"), "trace", "--file", str(lines)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bad_arguments_are_refused_before_any_request(capsys):
    # --url 'notaurl' ended in a traceback; the others reached the server (exit 1) or not.
    for flags, message in ((["--url", "notaurl"], "expected http://HOST:PORT, got 'notaurl'"),
                           (["--limit", "0"], "argument --limit: must be >= 1, got 0"),
                           (["--since", "-5"], "argument --since: must be >= 0, got -5"),
                           (["--since-s", "-1"], "argument --since-s: must be a finite"),
                           # Each was silently ignored beside the output that ran.
                           (["--ticks"], "--ticks applies to --png only"),
                           (["--json", "--perfetto", "t.json"],
                            "--json and --perfetto each choose the output: give one")):
        try:
            fairtick(["trace", *flags])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{flags} was taken")
        assert message in capsys.readouterr().err


def test_a_state_the_server_does_not_know_is_a_usage_error(mixed_server, capsys):
    assert fairtick(["trace", "--url", mixed_server.url, "--state", "nosuchstate"]) == 2
    assert "HTTP 400" in capsys.readouterr().err


def test_a_file_without_trace_events_is_an_error(tmp_path, capsys):
    # Each printed an empty table and exited 0.
    for text in ("garbage{\n", '{"tick": "x", "seq": 1, "to": "decoding"}\n', ""):
        path = tmp_path / "wrong.jsonl"
        path.write_text(text)
        assert fairtick(["trace", "--file", str(path)]) == 1
        assert f"no trace events in {path}" in capsys.readouterr().err
