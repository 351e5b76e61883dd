"""Grammar masks inside the batched step, over the real built-in model.

The built-in model's free output is printable noise, so every valid document here comes from the
mask alone. The schema bounds every string, array and integer, so the grammar forces the
document to end: every output, greedy or sampled, must end with EOS ("stop") and validate.
"""

from __future__ import annotations

import json
import random

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from runtime.api import GenerationRequest
from runtime.engine import Engine, EngineConfig
from runtime.executor import Executor, SequenceFault, Slice
from runtime.grammar import Grammar, GrammarMatcher, ResponseFormat, make_grammar_compiler
from runtime.model import EOS_ID, ModelBundle
from runtime.sampling import SamplingParams
from tests.runtime.engine_harness import Collector, submit, wait_until

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "count": {"type": "integer", "minimum": -5, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                           "active": {"type": "boolean"}},
            "required": ["id", "active"],
            "additionalProperties": False,
        },
        "ref": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    },
    "required": ["name", "kind", "count", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammar(bundle: ModelBundle) -> Grammar:
    return make_grammar_compiler(bundle).compile(ResponseFormat("json_schema", SCHEMA))


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def test_constrained_and_free_rows_share_the_batch(bundle: ModelBundle) -> None:
    engine, got = Engine(EngineConfig(max_running=8), bundle), Collector()
    engine.start()
    try:
        grammar = engine.grammars.compile(ResponseFormat("json_schema", SCHEMA))
        constrained = {
            "greedy-1": {}, "greedy-2": {},
            "sampled-1": {"temperature": 1.0, "seed": 1},
            "sampled-2": {"temperature": 1.0, "seed": 2},
            "sampled-3": {"temperature": 0.7, "top_p": 0.9, "seed": 3},
        }
        for i, (rid, sampling) in enumerate(constrained.items()):
            engine.submit(_request(rid, prompt(5 + 7 * i, i), grammar, max_tokens=600,
                                   **sampling), got.sink)
        submit(engine, got, "free", prompt(30, 99), max_tokens=40)
        got.wait("free", *constrained)
    finally:
        engine.stop()
    for rid in constrained:
        assert got.last(rid).finish_reason == "stop", rid
        jsonschema.validate(json.loads(got.text(rid)), SCHEMA)
    # The masked rows leave the free row exactly what the model alone gives it.
    assert got.tokens("free") == [t for t, _ in generate_step(
        mx.array(prompt(30, 99)), bundle.model, max_tokens=40)]
    assert got.last("free").finish_reason == "length"
    assert len({got.text(rid) for rid in constrained}) == len(constrained)


@pytest.mark.parametrize("failing", ["mask", "token"])
def test_a_row_whose_grammar_fails_fails_alone(bundle: ModelBundle, grammar: Grammar,
                                               failing: str, monkeypatch) -> None:
    # A grammar that fails mid-output, computing its mask or taking its token (llguidance's
    # parser gave up: injected here, as a schema whose recursion never ended once did it),
    # fails that request only: the rows beside it step again without it, and every token they
    # were sampled is published, the model's own. The failure once failed every row (and told
    # them the failing request's schema).
    engine, got = Engine(EngineConfig(max_running=8), bundle), Collector()
    engine.start()
    free = {"free-1": prompt(9, 41), "free-2": prompt(17, 42)}
    calls = 0
    name = "check" if failing == "mask" else "consume"
    real = getattr(GrammarMatcher, name)

    def fail_the_fifth(self: GrammarMatcher, *token: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("parser error: Too many items (injected)")
        real(self, *token)

    monkeypatch.setattr(GrammarMatcher, name, fail_the_fifth)
    try:
        for rid, tokens in free.items():
            submit(engine, got, rid, tokens, max_tokens=60)
        wait_until(lambda: all(len(got.tokens(rid)) >= 2 for rid in free))
        engine.submit(_request("bad", prompt(6, 43), grammar, max_tokens=300), got.sink)
        got.wait("bad", *free)
        assert engine.alive
    finally:
        engine.stop()
    last = got.last("bad")
    assert last.finish_reason == "error" and "Too many items (injected)" in last.error, last
    assert len(got.tokens("bad")) == 4  # the fifth mask or token failed
    for rid, tokens in free.items():
        assert got.last(rid).finish_reason == "length", got.last(rid).error
        assert got.last_order(rid) > got.last_order("bad"), "it still decoded when bad failed"
        assert got.tokens(rid) == [t for t, _ in generate_step(
            mx.array(tokens), bundle.model, max_tokens=60)]


def test_a_tick_whose_grammar_fails_commits_nothing(bundle: ModelBundle, grammar: Grammar,
                                                    monkeypatch) -> None:
    # Two constrained prompts end in one tick beside a decode row, and the second's first token
    # is refused: the tick raises naming it, and nothing moved (no prompt counted as
    # prefilled, no token taken, the first prompt's matcher rolled back), so the same tick run
    # again gives what it gives on an executor that never failed. Rows committed one by one
    # once kept the tokens of the rows before the failing one and lost them from the output.
    def start(ex: Executor) -> None:
        ex.add(0, prompt(8, 1), SamplingParams(max_tokens=20))
        ex.prefill(0, 100)
        for seq_id in (1, 2):
            ex.add(seq_id, prompt(5 + seq_id, seq_id), SamplingParams(max_tokens=50),
                   grammar=grammar)

    def ticks(ex: Executor) -> list[dict[int, int]]:
        out = [ex.run([Slice(1, 100), Slice(2, 100)], [0])]
        return out + [ex.run([], [0, 1, 2]) for _ in range(6)]

    reference, failing = Executor(bundle), Executor(bundle)
    start(reference)
    start(failing)
    real, taken = GrammarMatcher.consume, []

    def refuse_the_second(self: GrammarMatcher, token: int) -> None:
        taken.append(token)
        if len(taken) == 2:
            raise RuntimeError(f"the grammar refused token {token}: injected")
        real(self, token)

    with monkeypatch.context() as patch:
        patch.setattr(GrammarMatcher, "consume", refuse_the_second)
        with pytest.raises(SequenceFault) as info:
            failing.run([Slice(1, 100), Slice(2, 100)], [0])
    assert info.value.seq_id == 2 and len(taken) == 2
    assert (failing.prompt_left(1), failing.prompt_left(2)) == (6, 7)
    assert ticks(failing) == ticks(reference)


def test_max_tokens_cuts_a_constrained_output_with_length(bundle: ModelBundle,
                                                           grammar: Grammar) -> None:
    engine, got = Engine(EngineConfig(), bundle), Collector()
    engine.start()
    try:
        engine.submit(_request("cut", prompt(8, 1), grammar, max_tokens=10), got.sink)
        got.wait("cut")
    finally:
        engine.stop()
    assert got.last("cut").finish_reason == "length"
    assert got.last("cut").num_generated_tokens == 10
    assert got.text("cut").startswith('{"name": "')
    with pytest.raises(ValueError):
        json.loads(got.text("cut"))


def test_json_object_outputs_that_end_are_objects(bundle: ModelBundle) -> None:
    # Any JSON object is unbounded, so a noise model may run out of max_tokens; an output that
    # ends (EOS, "stop") must be a whole object, and one cut by max_tokens must not be.
    engine, got = Engine(EngineConfig(max_running=8), bundle), Collector()
    engine.start()
    ids = [f"o{seed}" for seed in range(6)]
    try:
        grammar = engine.grammars.compile(ResponseFormat("json_object"))
        for seed, rid in enumerate(ids):
            engine.submit(_request(rid, prompt(6, seed), grammar, max_tokens=300,
                                   temperature=1.0, seed=seed), got.sink)
        got.wait(*ids)
    finally:
        engine.stop()
    for rid in ids:
        if got.last(rid).finish_reason == "stop":
            assert isinstance(json.loads(got.text(rid)), dict)
        else:
            assert got.last(rid).finish_reason == "length"
            with pytest.raises(ValueError):
                json.loads(got.text(rid))


def test_grammar_decides_the_end_so_min_tokens_and_ignore_eos_are_refused(
        bundle: ModelBundle, grammar: Grammar) -> None:
    engine = Engine(EngineConfig(), bundle)
    engine.start()
    try:
        for sampling in ({"min_tokens": 3}, {"ignore_eos": True}):
            with pytest.raises(ValueError, match="response_format"):
                engine.submit(_request("x", [65], grammar, **sampling), lambda e: None)
    finally:
        engine.stop()


def test_an_evicted_constrained_sequence_continues_its_document(bundle: ModelBundle,
                                                                grammar: Grammar) -> None:
    # Preempted with its KV dropped, it prefills prompt + output again; the first token after
    # that prefill is masked from where the document was.
    ex = Executor(bundle)
    ex.add(0, prompt(9, 4), SamplingParams(temperature=1.0, seed=4, max_tokens=600),
           grammar=grammar)
    out = [ex.prefill(0, 1000)]
    for _ in range(25):
        out.append(ex.decode([0])[0])
    ex.evict(0)
    out.append(ex.prefill(0, 1000))
    while out[-1] != EOS_ID:
        assert len(out) < 600
        out.append(ex.decode([0])[0])
    text = bundle.tokenizer.decode(out[:-1])
    jsonschema.validate(json.loads(text), SCHEMA)


def _request(request_id: str, tokens: list[int], grammar: Grammar, n: int = 1,
             cache_prompt: bool = True, **sampling: object) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(tokens), SamplingParams(**sampling),  # type: ignore[arg-type]
                             n=n, cache_prompt=cache_prompt, grammar=grammar)


def choices(got: Collector, request_id: str, n: int) -> dict[int, tuple[str, str | None]]:
    """Each choice's text and finish reason, from the events of a request with `n` choices."""
    out: dict[int, tuple[str, str | None]] = {}
    for _, event in got.events[request_id]:
        text, finish = out.get(event.index, ("", None))
        out[event.index] = (text + event.text, event.finish_reason or finish)
    assert sorted(out) == list(range(n))
    return out


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 5}],
                         ids=["greedy", "sampled"])
def test_every_choice_of_n_follows_the_grammar_with_a_matcher_of_its_own(
        bundle: ModelBundle, grammar: Grammar, sampling: dict[str, object]) -> None:
    # The siblings fork the prompt's KV after its first token: each starts its own matcher at
    # the start of the document (the prompt's has consumed that token already).
    engine, got = Engine(EngineConfig(max_running=8), bundle), Collector()
    engine.start()
    try:
        engine.submit(_request("n4", prompt(12, 8), grammar, n=4, max_tokens=600, **sampling),
                      got.sink)
        got.wait("n4")
    finally:
        engine.stop()
    outputs = choices(got, "n4", 4)
    for text, finish in outputs.values():
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    texts = {text for text, _ in outputs.values()}
    assert len(texts) == (1 if not sampling else 4)  # greedy siblings agree; seeded ones differ


def test_a_constrained_request_reuses_a_cached_prefix(bundle: ModelBundle,
                                                      grammar: Grammar) -> None:
    # The grammar masks only generated tokens: the prompt's KV comes from the prefix cache as
    # for any request, and the output is the one a cold prefill gives.
    system = prompt(70, 9)
    engine, got = Engine(EngineConfig(), bundle), Collector()
    engine.start()
    try:
        submit(engine, got, "warm", system + [65], max_tokens=4)
        got.wait("warm")
        wait_until(lambda: engine.executor.num_sequences == 0)
        engine.submit(_request("hit", system + [66, 67], grammar, max_tokens=600), got.sink)
        engine.submit(_request("cold", system + [66, 67], grammar, max_tokens=600,
                               cache_prompt=False), got.sink)
        got.wait("hit", "cold")
    finally:
        engine.stop()
    assert got.last("hit").num_cached_tokens >= 64 and got.last("cold").num_cached_tokens == 0
    assert got.text("hit") == got.text("cold")
    jsonschema.validate(json.loads(got.text("hit")), SCHEMA)


def test_top_k_chooses_among_the_tokens_the_grammar_allows(bundle: ModelBundle,
                                                           grammar: Grammar) -> None:
    # top_k 1 keeps one token. Kept from the unmasked logits it would be the model's own choice
    # (noise, never `{`), and nothing allowed would be left to draw: the mask comes first.
    engine, got = Engine(EngineConfig(), bundle), Collector()
    engine.start()
    try:
        engine.submit(_request("k1", prompt(10, 3), grammar, max_tokens=600, temperature=1.0,
                               top_k=1, top_p=0.5, seed=3), got.sink)
        got.wait("k1")
    finally:
        engine.stop()
    assert got.last("k1").finish_reason == "stop"
    jsonschema.validate(json.loads(got.text("k1")), SCHEMA)


def test_the_mask_comes_after_logit_bias_penalties_and_before_min_p(bundle: ModelBundle,
                                                                     grammar: Grammar) -> None:
    # A bias of +100 on a letter the grammar mostly refuses, penalties and min_p: the grammar
    # still decides (the mask after the controls that change logits, before the filters).
    engine, got = Engine(EngineConfig(), bundle), Collector()
    engine.start()
    try:
        engine.submit(_request("ctl", prompt(10, 6), grammar, max_tokens=600, temperature=1.0,
                               seed=6, min_p=0.5, presence_penalty=2.0,
                               frequency_penalty=1.0, logit_bias=((ord("Q"), 100.0),)),
                      got.sink)
        got.wait("ctl")
    finally:
        engine.stop()
    assert got.last("ctl").finish_reason == "stop"
    jsonschema.validate(json.loads(got.text("ctl")), SCHEMA)
