"""`fairtick trace --request ID` and `--perfetto FILE` against a real server."""

from __future__ import annotations

import json

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
