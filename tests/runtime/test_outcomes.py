"""One outcome per client request, on the real engine: every choice (`n`) of every prompt of a
completions batch (engine requests sharing a `response_id`) is counted once in the outcome
counters and the latency histograms and logged in one line under the id the client saw. The
finish_reason and cause rules are docs/operations.md's."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from runtime.api import EngineFull, GenerationRequest
from runtime.engine import Engine
from runtime.outcomes import ResponseTally, SequenceEnd
from runtime.sampling import SamplingParams
from tests.runtime.engine_harness import Collector, submit, wait_until
from tests.runtime.test_engine import make_engine, prompt
from tests.server.outcome_helpers import (
    ABORTED,
    FINISHED,
    Series,
    outcome_moves,
    parse_samples,
    request_lines,
    series,
)

HISTOGRAMS = ("fairtick_e2e_request_latency_seconds", "fairtick_time_to_first_token_seconds",
              "fairtick_request_queue_time_seconds")


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="fairtick.requests")
    return caplog


def samples(engine: Engine) -> dict[Series, float]:
    return parse_samples(generate_latest(engine.registry).decode())


def observed(engine: Engine) -> dict[str, float]:
    every = samples(engine)
    return {name: every[series(f"{name}_count")] for name in HISTOGRAMS}


def batch(response_id: str, prompts: list[list[int]], n: int = 1,
          **sampling: object) -> list[GenerationRequest]:
    """The engine requests the server makes of a completions batch: one per prompt."""
    return [GenerationRequest(f"{response_id}-{i}", tuple(p), SamplingParams(**sampling), n=n,
                              response_id=response_id, num_prompts=len(prompts))
            for i, p in enumerate(prompts)]


def num_ended(got: Collector, request_id: str) -> int:
    return sum(e.finish_reason is not None for _, e in got.events[request_id])


def one_line(caplog, request_id: str) -> dict[str, str]:
    wait_until(lambda: request_lines(caplog, request_id))
    [line] = request_lines(caplog, request_id)
    return line


def test_n_choices_are_one_finished_request(bundle, lines):
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    try:
        tokens = prompt(9, 1)
        engine.submit(GenerationRequest("solo", tuple(tokens), SamplingParams(max_tokens=4),
                                        n=3), got.sink)
        wait_until(lambda: num_ended(got, "solo") == 3)
        line = one_line(lines, "solo")
        wait_until(lambda: not engine.snapshot()["sequences"])
    finally:
        engine.stop()
    assert (line["outcome"], line["finish_reason"]) == ("finished", "length")
    assert (int(line["prompt_tokens"]), int(line["completion_tokens"])) == (9, 3 * 4)
    assert outcome_moves({}, samples(engine)) == {series(FINISHED, finish_reason="length"): 1}
    assert observed(engine) == dict.fromkeys(HISTOGRAMS, 1)


def test_a_batch_is_one_request_logged_under_the_id_the_client_saw(bundle, lines):
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    prompts = [prompt(7, 2), prompt(11, 3)]
    try:
        for request in batch("cmpl-b", prompts, n=2, max_tokens=3):
            engine.submit(request, got.sink)
        wait_until(lambda: num_ended(got, "cmpl-b-0") == num_ended(got, "cmpl-b-1") == 2)
        line = one_line(lines, "cmpl-b")
        wait_until(lambda: not engine.snapshot()["sequences"])
    finally:
        engine.stop()
    assert (line["outcome"], line["finish_reason"]) == ("finished", "length")
    assert int(line["prompt_tokens"]) == 7 + 11, "each prompt once, not once per choice"
    assert int(line["completion_tokens"]) == 2 * 2 * 3
    assert request_lines(lines, "cmpl-b-0") == request_lines(lines, "cmpl-b-1") == []
    assert outcome_moves({}, samples(engine)) == {series(FINISHED, finish_reason="length"): 1}
    assert observed(engine) == dict.fromkeys(HISTOGRAMS, 1)


def test_aborted_choices_are_one_aborted_request_with_its_prompt_counted_once(bundle, lines):
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    try:
        engine.submit(GenerationRequest("gone", tuple(prompt(8, 4)),
                                        SamplingParams(max_tokens=10_000), n=3), got.sink)
        wait_until(lambda: len({e.index for _, e in got.events["gone"]}) == 3)
        engine.abort("gone")
        line = one_line(lines, "gone")
        wait_until(lambda: not engine.snapshot()["sequences"])
    finally:
        engine.stop()
    assert (line["outcome"], line["cause"], line["finish_reason"]) == \
        ("aborted", "client_disconnect", "abort")
    assert int(line["prompt_tokens"]) == 8
    assert int(line["completion_tokens"]) == len(got.tokens("gone"))
    assert outcome_moves({}, samples(engine)) == {series(ABORTED, cause="client_disconnect"): 1}
    assert observed(engine)["fairtick_e2e_request_latency_seconds"] == 0, "finished ones only"


def test_a_batch_refused_at_a_later_prompt_is_not_counted_by_the_engine(bundle, lines):
    # The server answers it 429 and counts that refusal; the prompt the engine had taken is
    # aborted (cause error, as the server does) and counted nowhere else.
    engine, got = make_engine(bundle, "mixed_step", max_running=1, max_waiting=2), Collector()
    try:
        submit(engine, got, "holder", prompt(5, 5), max_tokens=10_000)
        wait_until(lambda: got.tokens("holder"))
        submit(engine, got, "queued", prompt(5, 6), max_tokens=2)
        first, second = batch("cmpl-r", [prompt(5, 7), prompt(5, 8)], max_tokens=2)
        engine.submit(first, got.sink)
        with pytest.raises(EngineFull):
            engine.submit(second, got.sink)
        engine.abort(first.request_id, "error")
        got.wait(first.request_id)
        engine.abort("holder")
        got.wait("holder", "queued")
        wait_until(lambda: request_lines(lines, "holder") and request_lines(lines, "queued"))
        wait_until(lambda: not engine.snapshot()["sequences"])
    finally:
        engine.stop()
    assert request_lines(lines, "cmpl-r") == request_lines(lines, "cmpl-r-0") == []
    assert outcome_moves({}, samples(engine)) == {series(ABORTED, cause="client_disconnect"): 1,
                                                  series(FINISHED, finish_reason="length"): 1}


def ended(reason: str, cause: str | None = None, end_s: float = 1.0) -> SequenceEnd:
    return SequenceEnd(reason, cause, 2, end_s, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ends", "reason", "cause"), [
    ([ended("stop"), ended("length")], "length", None),
    ([ended("stop"), ended("stop")], "stop", None),
    ([ended("length"), ended("abort", "client_disconnect"), ended("error", "error")],
     "abort", "client_disconnect"),
    ([ended("stop"), ended("error", "error"), ended("abort", "error")], "error", "error"),
])
def test_a_response_ends_as_the_documented_rule_says(ends, reason, cause):
    # docs/operations.md: aborted with its first unfinished sequence's cause and finish_reason;
    # else length if any choice ran out of max_tokens, else stop.
    tally = ResponseTally("cmpl-x", 1, submitted_s=0.0)
    tally.take(5)
    for _ in ends[1:]:
        tally.fork()
    for end in ends:
        assert not tally.done
        tally.end(end)
    outcome = tally.outcome()
    assert (outcome.finish_reason, outcome.cause) == (reason, cause)
    assert (outcome.num_prompt_tokens, outcome.num_generated_tokens) == (5, 2 * len(ends))
