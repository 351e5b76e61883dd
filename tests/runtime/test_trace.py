"""The trace per request, on the real engine: arrival, waits compressed into runs with the rule
that decided them (checked against the engine's own tick records), preemptions, refusals, the
documented event schema, the story `fairtick trace --request` prints, and the Perfetto export
against the Trace Event Format. Every sequence of a request (its choices, a batch's prompts) is
traced under the id its client saw."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

from runtime.api import EngineFull, GenerationRequest
from runtime.sampling import SamplingParams
from server.trace_perfetto import to_perfetto
from statemachine.trace_story import format_request
from tests.runtime.engine_harness import Collector, submit, wait_until
from tests.runtime.test_engine import make_engine, prompt
from tests.runtime.test_outcomes import batch

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "trace-event.schema.json").read_text())


@pytest.fixture(scope="module")
def pressured(bundle):
    """Five requests through a KV budget too small for them, with 3 running places: they queue
    for room and places, park beside decoding ones, and are preempted (recompute)."""
    engine, got = make_engine(bundle, "grant_counter", max_running=3, max_kv_tokens=150), \
        Collector()
    try:
        for i in range(5):
            submit(engine, got, f"r{i}", prompt(20 + 25 * i, i), max_tokens=30)
        got.wait(*(f"r{i}" for i in range(5)))
    finally:
        engine.stop()
    return engine, engine.trace.events()


def test_every_event_follows_the_documented_schema(pressured):
    _, events = pressured
    for event in events:
        jsonschema.validate(event, SCHEMA)
    assert {e["kind"] for e in events} == {"arrival", "transition", "wait"}


def test_each_request_begins_with_its_arrival_and_carries_its_id(pressured):
    engine, events = pressured
    for i in range(5):
        mine = [e for e in events if e["request_id"] == f"r{i}"]
        assert mine[0]["kind"] == "arrival" and mine[0]["role"] == "queued"
        assert len({e["seq"] for e in mine}) == 1, "one request, one sequence"
        assert mine[-1]["role"] == "finished"
        times = [e["t_s"] for e in mine]
        assert times == sorted(times) and times[0] >= 0
        assert all(e["t_s"] == pytest.approx(e["time"] - engine.trace.started, abs=1e-5)
                   for e in mine)


def test_parked_waits_name_the_rule_of_the_ticks_they_cover(pressured):
    # The wait runs come from the scheduler; the tick records from the engine's own loop.
    engine, events = pressured
    rule_of = {t.tick: t.rule for t in engine.trace.ticks()}
    parked = [e for e in events if e["kind"] == "wait" and e["role"] == "parked"]
    assert parked, "nothing parked beside a decoding sequence: not a test of waits"
    for run in parked:
        covered = [rule_of[t] for t in range(run["tick"], run["tick"] + run["ticks"])]
        assert set(covered) == {run["rule"]}, run
        assert not run["ongoing"]
    # Compressed: two runs of a sequence with nothing between them differ in rule or state.
    for seq in {e["seq"] for e in parked}:
        mine = [e for e in events if e["seq"] == seq]
        for a, b in zip(mine, mine[1:], strict=False):
            if a["kind"] == b["kind"] == "wait":
                assert (a["rule"], a["from"]) != (b["rule"], b["from"]), (a, b)
                assert a["tick"] + a["ticks"] <= b["tick"]
    assert max(e["ticks"] for e in parked) > 1, "no run of several ticks"


def test_queued_waits_say_what_was_missing_and_preemptions_show(pressured):
    _, events = pressured
    queued = [e for e in events if e["kind"] == "wait" and e["role"] in ("queued", "preempted")]
    assert {e["rule"] for e in queued} <= {"kv_budget", "running_limit"}
    assert "kv_budget" in {e["rule"] for e in queued}
    preempted = [e for e in events if e["kind"] == "transition" and e["role"] == "preempted"]
    assert preempted, "the budget never ran short: not a test of preemption"


def test_the_story_of_a_preempted_request_is_a_few_lines_in_seconds(pressured):
    _, events = pressured
    rid = next(e["request_id"] for e in events if e["role"] == "preempted")
    story = format_request(events, rid)
    lines = story.splitlines()
    assert lines[0].startswith(f"request {rid} (seq ")
    assert len(lines) <= 12, story
    assert any("queued" in line and "under kv_budget" in line for line in lines), story
    # It parked beside decoding streams: the policy's rule that kept it there is named.
    rules = {e["rule"] for e in events if e["request_id"] == rid and e["kind"] == "wait"
             and e["role"] == "parked"}
    assert rules and all(any("prefill" in line and f"under {rule}" in line for line in lines)
                         for rule in rules), story
    assert any(line.strip().startswith(("0.000", "0.0")) for line in lines[1:]), story
    preemptions = sum(e["role"] == "preempted" and e["kind"] == "transition"
                      for e in events if e["request_id"] == rid)
    assert f"preempted {preemptions} time" in lines[-1], story
    assert "first token at" in lines[-1] and "finished" in lines[-1], story
    assert format_request(events, "nobody").endswith("older than the trace's buffer)")


def test_the_perfetto_export_is_the_trace_event_format(pressured):
    engine, events = pressured
    out = to_perfetto(events, engine.trace.ticks(), engine.trace.started)
    json.dumps(out)  # plain JSON
    trace = out["traceEvents"]
    for e in trace:
        assert e["ph"] in {"X", "i", "C", "M"} and isinstance(e["name"], str)
        assert isinstance(e["pid"], int)
        if e["ph"] != "M":
            assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["tid"], int)
    tracks = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {f"seq {s} r{s}" for s in range(5)} <= tracks  # one track per sequence
    ticks = [e for e in trace if e["ph"] == "X" and e.get("cat") == "tick"]
    assert len(ticks) == len(engine.trace.ticks())
    counters = Counter(e["name"] for e in trace if e["ph"] == "C")
    assert counters["batch"] == counters["kv_tokens"] == len(ticks)
    # A state slice per lifecycle state a sequence was in, in seconds -> microseconds.
    first = next(e for e in events if e["kind"] == "transition")
    slice_ = next(e for e in trace if e["ph"] == "X" and e.get("cat") == "state"
                  and e["args"]["tick"] == first["tick"] and e["name"] == first["to"])
    assert slice_["ts"] == pytest.approx((first["time"] - engine.trace.started) * 1e6, abs=1)


def test_a_refusal_is_in_the_trace(bundle):
    engine, got = make_engine(bundle, "mixed_step", max_running=1, max_waiting=1), Collector()
    try:
        submit(engine, got, "a", prompt(10, 1), max_tokens=200)
        wait_until(lambda: got.tokens("a"))
        submit(engine, got, "b", prompt(10, 3), max_tokens=5)
        with pytest.raises(EngineFull):
            submit(engine, got, "c", prompt(10, 4), max_tokens=5)
        wait_until(lambda: [e for e in engine.trace.events(request_id="b")
                            if e["kind"] == "wait" and e["ongoing"]])  # a run still open
        engine.abort("a")
        got.wait("a", "b")
    finally:
        engine.stop()
    [refusal] = [e for e in engine.trace.events() if e["kind"] == "refusal"]
    assert (refusal["request_id"], refusal["rule"], refusal["seq"]) == ("c", "queue_full", None)
    jsonschema.validate(refusal, SCHEMA)
    waits = [e for e in engine.trace.events(request_id="b") if e["kind"] == "wait"]
    assert waits and waits[0]["rule"] == "running_limit"


def test_every_sequence_of_a_batch_is_traced_under_the_id_the_client_saw(bundle):
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    parts = batch("cmpl-b", [prompt(7, 2), prompt(11, 3)], n=2, max_tokens=3)
    try:
        for part in parts:
            engine.submit(part, got.sink)
        wait_until(lambda: all(sum(e.finish_reason is not None for _, e in got.events[p.request_id])
                               == 2 for p in parts))
        wait_until(lambda: not engine.snapshot()["sequences"])
    finally:
        engine.stop()
    events = engine.trace.events(request_id="cmpl-b")
    assert len({e["seq"] for e in events}) == 4, "two choices of each of two prompts"
    assert len([e for e in events if e["kind"] == "arrival"]) == 2, "the prompts' own arrivals"
    assert engine.trace.events(request_id="cmpl-b-0") == [], "an id no client sees"
    for event in events:
        jsonschema.validate(event, SCHEMA)
    story = format_request(events, "cmpl-b").splitlines()
    assert len([line for line in story if line.startswith("request cmpl-b (seq ")]) == 4


def test_a_batch_refused_at_a_later_prompt_is_traced_under_the_id_the_client_saw(bundle):
    engine, got = make_engine(bundle, "mixed_step", max_running=1, max_waiting=1), Collector()
    first, second = batch("cmpl-r", [prompt(5, 7), prompt(5, 8)], max_tokens=2)
    try:
        engine.submit(GenerationRequest("holder", tuple(prompt(5, 5)),
                                        SamplingParams(max_tokens=10_000)), got.sink)
        wait_until(lambda: got.tokens("holder"))
        engine.submit(first, got.sink)
        with pytest.raises(EngineFull):
            engine.submit(second, got.sink)
        engine.abort(first.request_id, "error")
        engine.abort("holder")
        got.wait(first.request_id, "holder")
    finally:
        engine.stop()
    [refusal] = [e for e in engine.trace.events() if e["kind"] == "refusal"]
    assert (refusal["request_id"], refusal["rule"]) == ("cmpl-r", "queue_full")
    kinds = [e["kind"] for e in engine.trace.events(request_id="cmpl-r")]
    assert kinds.count("arrival") == kinds.count("refusal") == 1, "one prompt in, one refused"
    # In the order it happened: the first prompt arrived, then the batch was refused.
    assert kinds.index("arrival") < kinds.index("refusal"), kinds
