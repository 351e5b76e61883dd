"""The admission scenario in small, through the real server, under every shipped policy.

Three streams decode; then a prompt of several chunks is admitted. Under every policy except
`baseline` the prompt's chunks run while the streams keep decoding, and its first token comes
before any stream finishes; under `baseline` (the defect) it waits until all of them are done.
How long the streams must run for that to be a fair test comes from each policy's own TTFT
claim, not from a copy of the policy here.
"""

from __future__ import annotations

import json
import threading

import pytest

from statemachine.invariants import implied_ttft
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy
from tests.e2e.conftest import start_server, stop_server
from tests.lifecycle_names import ADMIT, DECODING, FINISH
from tests.server.http_helpers import OpenStream, get

RUNNING, CHUNK, CHUNKS, STREAMS = 4, 32, 5, 3
PROMPT = "p" * (CHUNK * (CHUNKS - 1) + 8)  # with BOS: CHUNKS chunks
# The streams decode on while the test reads their first tokens, the trace and the counters
# before it sends the prompt: 42 tokens on a fast CI machine (a decode step ~1-2 ms here).
MIN_STREAM_TOKENS, MARGIN_TICKS = 120, 300


def ttft_claim(policy: str) -> int | None:
    """The TTFT its policy's claims give this prompt, in ticks, when it fits on arrival: no tick
    queued, never preempted, so the wait bound alone (None: unbounded)."""
    wait = make_policy(policy).claim("wait_ticks", max_running=RUNNING)
    return implied_ttft(CHUNKS, wait, 0, 0)


def stream_tokens(policy: str) -> int:
    """Tokens the streams run for: more than the prompt's TTFT claim, and a margin for the tokens
    they decode before the prompt is admitted."""
    claim = ttft_claim(policy)
    return MIN_STREAM_TOKENS if claim is None else max(MIN_STREAM_TOKENS, claim + MARGIN_TICKS)


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = get(url, "/metrics").body.decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


def trace(url: str) -> list[dict]:
    return [json.loads(line) for line in get(url, "/debug/trace").body.decode().splitlines()]


def admitted_seqs(events: list[dict]) -> list:
    return [e["seq"] for e in events if e["trigger"] == ADMIT]


def run_scenario(url: str, max_tokens: int) -> dict:
    """Streams first, then the prompt; returns the trace split by who is who, and counters."""
    before_streams = len(trace(url))
    streams = [OpenStream(url, "/v1/completions",
                          {"prompt": f"stream {i}", "max_tokens": max_tokens, "stream": True,
                           "cache_prompt": False})
               for i in range(STREAMS)]
    for stream in streams:
        stream.read_event()
    before_prompt, at_admission = len(trace(url)), counters(url)
    prompt = OpenStream(url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 2, "stream": True,
                         "cache_prompt": False})  # every run prefills it in chunks
    # The prompt was submitted before its headers came, so it is admitted by the next tick at
    # the latest: by then no stream has more than one token beyond what the state shows now.
    ids = {stream.request_id for stream in streams}
    ahead = 1 + max(s["generated"] for s in get(url, "/debug/state").json()["sequences"]
                    if s["request_id"] in ids)
    readers = [threading.Thread(target=drain, args=(s,)) for s in streams]
    for reader in readers:
        reader.start()
    prompt.read_event()
    at_first_token = counters(url)
    drain(prompt)
    for reader in readers:
        reader.join(60)
    events = trace(url)
    return {"streams": admitted_seqs(events[before_streams:before_prompt]),
            "prompt": admitted_seqs(events[before_prompt:]), "events": events, "ahead": ahead,
            "delta": {k: at_first_token.get(k, 0) - v for k, v in at_admission.items()}}


def drain(stream: OpenStream) -> None:
    while stream.read_event() != "[DONE]":
        pass
    stream.drop()


@pytest.mark.parametrize("policy", shipped_policy_names())
def test_admission_under_a_busy_batch(policy, tmp_path):
    server = start_server(tmp_path, "--policy", policy, "--max-running", str(RUNNING),
                          "--prefill-chunk-size", str(CHUNK))
    try:
        run = run_scenario(server.url, stream_tokens(policy))
    finally:
        stop_server(server)
    claim = ttft_claim(policy)
    if claim is not None:
        left = stream_tokens(policy) - run["ahead"]
        assert left > claim, (f"not a fair test: the streams had {left} tokens left when the "
                              f"prompt came, its TTFT claim is {claim} ticks; raise MARGIN_TICKS")
    assert len(run["streams"]) == STREAMS and len(run["prompt"]) == 1, run["events"][-30:]
    (prompt_seq,) = run["prompt"]
    events = run["events"]
    first_token_tick = min(e["tick"] for e in events
                           if e["seq"] == prompt_seq and e["to"] == DECODING)
    finish_ticks = [e["tick"] for e in events
                    if e["seq"] in run["streams"] and e["trigger"] == FINISH]
    assert len(finish_ticks) == STREAMS
    if policy == "baseline":
        assert first_token_tick > max(finish_ticks), "baseline must show the defect"
        return
    assert first_token_tick < min(finish_ticks), f"{policy}: the prompt starved"
    delta = run["delta"]
    assert delta["fairtick_prefill_chunks_total"] >= CHUNKS
    decoded = delta["fairtick_decode_steps_total"] + delta.get("fairtick_mixed_steps_total", 0)
    assert decoded > 0, "the streams must keep decoding while the prompt is prefilled"
