"""Log-probabilities through the real Engine: on the events of the tokens they belong to, the
prompt's once with the first token, none for an EOS that ended the text; for each of `n`
choices; and a prompt whose own are asked for runs whole, past the prefix cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime.api import GenerationRequest
from runtime.sampling import SamplingParams
from tests.runtime.engine_harness import Collector, submit, wait_until
from tests.runtime.test_engine import make_engine, prompt, reference


def test_every_token_event_carries_its_logprobs_and_the_first_the_prompts(eos_bundle):
    engine, got = make_engine(eos_bundle, "mixed_step"), Collector()
    # The prompts of test_engine's EOS test (a third reach EOS), and one of several slices.
    prompts = {f"r{i}": prompt(10, i) for i in range(12)} | {"long": prompt(90, 99)}
    try:
        for request_id, tokens in prompts.items():
            submit(engine, got, request_id, tokens, max_tokens=48, logprobs=3,
                   prompt_logprobs=1)
        got.wait(*prompts)
    finally:
        engine.stop()
    stopped = 0
    for request_id, tokens in prompts.items():
        events = [e for _, e in got.events[request_id]]
        assert events[0].prompt_logprobs is not None
        assert all(e.prompt_logprobs is None for e in events[1:]), "the prompt's are sent once"
        logits = eos_bundle.model(mx.array(tokens)[None])[0].astype(mx.float32)
        rows = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        assert [lp.token_id for lp in events[0].prompt_logprobs] == tokens[1:]
        assert [lp.logprob for lp in events[0].prompt_logprobs] == pytest.approx(
            [rows[p][tokens[p + 1]] for p in range(len(tokens) - 1)], abs=1e-4)
        for event in events:
            if event.token_id in eos_bundle.eos_token_ids and event.finish_reason == "stop":
                assert event.logprob is None, "EOS is not in the text"
                stopped += 1
            else:
                assert event.logprob is not None and event.logprob.token_id == event.token_id
                assert len(event.logprob.top) == 3
    assert stopped, "the EOS-capable model never produced EOS"


def log_softmax_rows(bundle, tokens: list[int]) -> np.ndarray:
    """Row p: the model's log-probabilities after tokens[: p + 1], from one forward of its own."""
    logits = bundle.model(mx.array(tokens)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_each_choice_carries_its_own_logprobs_and_the_prompts(bundle):
    # n = 3 seeded choices sharing one prefill: every token of every choice comes with the
    # model's log-probability of it after that choice's own text; each choice's first event
    # carries the prompt's (found once, by the shared prefill).
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    tokens = prompt(40, 7)
    sampling = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2,
                              prompt_logprobs=1)
    try:
        engine.submit(GenerationRequest("r", tuple(tokens), sampling, n=3), got.sink)
        got.wait("r")
    finally:
        engine.stop()
    rows = log_softmax_rows(bundle, tokens)
    expected_prompt = [rows[p][tokens[p + 1]] for p in range(len(tokens) - 1)]
    texts = []
    for index in range(3):
        events = [e for _, e in got.events["r"] if e.index == index]
        assert events[-1].finish_reason == "length"
        assert [lp.logprob for lp in events[0].prompt_logprobs] == pytest.approx(
            expected_prompt, abs=1e-4), index
        assert all(e.prompt_logprobs is None for e in events[1:])
        generated = [e.token_id for e in events]
        after = log_softmax_rows(bundle, tokens + generated)[len(tokens) - 1:]
        for event, row in zip(events, after, strict=False):
            assert event.logprob.token_id == event.token_id and len(event.logprob.top) == 2
            assert event.logprob.logprob == pytest.approx(row[event.token_id], abs=1e-4)
            assert event.logprob.top[0][1] == pytest.approx(row.max(), abs=1e-4)
        texts.append(tuple(generated))
    assert len(set(texts)) == 3, "each choice draws its own tokens"


def test_a_prompt_whose_logprobs_are_asked_for_bypasses_the_prefix_cache(bundle):
    # A cached prefix has no log-probabilities: a request asking for its prompt's (echo) runs
    # every prompt token; one asking only for its tokens' still starts from the cache.
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    base = prompt(70, 3)
    try:
        submit(engine, got, "warm", base, max_tokens=4)
        got.wait("warm")
        wait_until(lambda: engine.executor.num_sequences == 0)
        submit(engine, got, "echo", base + [70], max_tokens=4, logprobs=0, prompt_logprobs=0)
        got.wait("echo")
        submit(engine, got, "plain", base + [71], max_tokens=4, logprobs=0)
        got.wait("plain")
    finally:
        engine.stop()
    assert got.last("warm").num_cached_tokens == 0
    assert got.last("echo").num_cached_tokens == 0, "the cache was not used"
    assert got.last("plain").num_cached_tokens > 0, "the cache still serves the others"
    echo = base + [70]
    first = got.events["echo"][0][1]
    rows = log_softmax_rows(bundle, echo)
    assert [lp.token_id for lp in first.prompt_logprobs] == echo[1:]
    assert [lp.logprob for lp in first.prompt_logprobs] == pytest.approx(
        [rows[p][echo[p + 1]] for p in range(len(echo) - 1)], abs=1e-4)
    for rid, tokens in (("echo", echo), ("plain", base + [71])):
        assert got.tokens(rid) == reference(bundle, tokens, 4), rid


def test_the_engine_refuses_controls_outside_their_ranges_at_submit(bundle):
    # What a caller of the engine (not the server) gets: a ValueError naming the field, and the
    # engine goes on serving.
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    try:
        for bad, words in ((dict(logit_bias=((bundle.vocab_size, 1.0),)), "inside the vocab"),
                           (dict(logit_bias=((5, 1.0), (5, 2.0))), "each id once"),
                           (dict(min_p=1.5), "min_p"), (dict(logprobs=21), "logprobs")):
            with pytest.raises(ValueError, match=words):
                submit(engine, got, "bad", prompt(5, 1), **bad)
        submit(engine, got, "good", prompt(5, 1), max_tokens=2, logit_bias=((66, 100.0),))
        got.wait("good")
    finally:
        engine.stop()
    assert got.tokens("good") == [66, 66]
