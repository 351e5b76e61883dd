"""Validation never crashes: any JSON body is a ValidRequest or a 4xx ApiError naming a reason;
any bytes are a JSON object or a 4xx. Hypothesis generates the bodies (no engine, no HTTP); the
prompts are tokenized by the built-in model's real tokenizer. Strings that UTF-8 cannot carry
(lone surrogates) stop at `parse_body`, so bodies here have none. Bodies drawn from the models'
JSON schemas are read by the models themselves (the schema says what they accept).
test_body_fuzz.py sends the documented-shape and the schema bodies over HTTP to the real app."""

from __future__ import annotations

import dataclasses
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliabilitylib.bodies import CHAT, COMPLETIONS, fuzzed_bodies, top_level
from reliabilitylib.schema_bodies import MODELS, body_strategy, schema_bodies

from runtime.model import BUILTIN_CONFIG
from server.body_reading import read_body
from server.errors import ApiError
from server.validation import BODY_MODELS, parse_body, validate_request
from tests.server.test_validation import CONTEXT, encoder, limits

FIELD_NAMES = sorted(set(BODY_MODELS["completion"].model_fields)
                     | set(BODY_MODELS["chat"].model_fields)) + ["wat"]
EDGE_VALUES = [0, 1, -1, 2**31, 2**63, 2**64, 10**400, -(10**400), 1e30, -0.0, 1e-320, "", [], {},
               float("nan"), float("inf"), "\x00", CONTEXT, CONTEXT + 1]
# The first token id past the vocabulary, read from the model when first drawn.
EDGES = st.sampled_from(EDGE_VALUES) | st.deferred(lambda: st.just(limits().vocab_size))
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
                   EDGES)
KEYS = st.one_of(st.text(max_size=6),
                 st.sampled_from(["role", "content", "type", "text", "include_usage", "5"]))
VALUES = st.recursive(LEAVES, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(KEYS, children, max_size=4)), max_leaves=10)
SETTINGS = settings(max_examples=300, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))
SCHEMA_SETTINGS = settings(SETTINGS, max_examples=200)


def test_failures_print_a_replay_blob():
    # tests/conftest.py loads the profile before this module builds SETTINGS from it.
    assert SETTINGS.print_blob


def check_api_error(exc: ApiError) -> None:
    assert 400 <= exc.status < 500, exc.message
    body = exc.to_body()["error"]
    assert body["message"] and body["type"] == "invalid_request_error"
    json.dumps(body)  # the error itself must be serializable


@SETTINGS
@given(kind=st.sampled_from(["completion", "chat"]),
       body=st.dictionaries(st.sampled_from(FIELD_NAMES), VALUES, max_size=6),
       base=st.booleans())
def test_any_body_is_valid_or_a_4xx(kind, body, base):
    if base:  # most fields then reach their own checks instead of stopping at a missing prompt
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **body}
        body.pop("messages" if kind == "completion" else "prompt")
    try:
        valid = validate_request(kind, body, limits(), encoder())
    except ApiError as exc:
        check_api_error(exc)
        return
    assert valid.prompt_tokens and all(0 <= t < limits().vocab_size for t in valid.prompt_tokens)
    assert len(valid.prompt_tokens) + valid.sampling.max_tokens <= CONTEXT
    valid.sampling.validate()


@SETTINGS
@given(kind=st.sampled_from(["completion", "chat"]), field=st.sampled_from(FIELD_NAMES),
       value=st.one_of(EDGES, VALUES))
def test_one_bad_field_in_a_good_body_is_a_4xx_naming_it(kind, field, value):
    body = {"prompt": "hi"} if kind == "completion" else {
        "messages": [{"role": "user", "content": "hi"}]}
    body = {**body, "max_tokens": 4, field: value}
    try:
        validate_request(kind, body, limits(), encoder())
    except ApiError as exc:
        check_api_error(exc)
        if field in BODY_MODELS[kind].model_fields and exc.status == 400:
            assert exc.param is not None and exc.param.split("[")[0].split(".")[0] in (
                field, "max_tokens"), (field, exc.param, exc.message)


@SETTINGS
@given(data=st.one_of(st.binary(max_size=64),
                      st.recursive(LEAVES, lambda c: st.lists(c, max_size=3), max_leaves=8)
                      .map(lambda v: json.dumps(v).encode()),
                      st.integers(1, 200).map(lambda n: b"[" * n + b"]" * n),
                      st.sampled_from([b'{"a": "\\ud800"}', b'{"a": NaN}', b"1e400", b"\xff"])),
       content_type=st.sampled_from([None, "application/json", "text/plain", "",
                                     "application/json; charset=utf-8", "application/x+json"]))
def test_any_bytes_are_an_object_or_a_4xx(data, content_type):
    try:
        assert isinstance(parse_body(data, content_type, 1024), dict)
    except ApiError as exc:
        check_api_error(exc)


FULL_CONTEXT = BUILTIN_CONFIG["max_position_embeddings"]


@SETTINGS
@given(case=fuzzed_bodies(FULL_CONTEXT))
def test_a_documented_body_with_wrong_values_is_valid_or_a_400_naming_a_changed_field(case):
    # The model's whole context: the body's own fields, not its length, are at fault here.
    full = dataclasses.replace(limits(), context_length=FULL_CONTEXT)
    kind = "chat" if case.path == CHAT else "completion"
    try:  # NaN and the infinities stop at parse_body, naming where they are
        body = parse_body(case.encoded(), "application/json", 1 << 20)
        valid = validate_request(kind, body, full, encoder())
    except ApiError as exc:
        check_api_error(exc)
        assert exc.param is not None and top_level(exc.param) in case.fields, \
            (case.changed, exc.param, exc.message)
        return
    assert 1 <= valid.sampling.max_tokens <= 16
    valid.sampling.validate()


@SCHEMA_SETTINGS
@given(data=st.data(), path=st.sampled_from(sorted(MODELS)))
def test_the_models_read_every_body_their_json_schema_allows(data, path):
    # Without the vocabulary: the schema cannot say which token ids the served model has.
    body = data.draw(body_strategy(path))
    read_body(MODELS[path], body)


@SCHEMA_SETTINGS
@given(case=schema_bodies(FULL_CONTEXT))
def test_a_schema_body_is_valid_or_a_4xx_naming_a_field_it_holds_or_needs(case):
    if case.path not in (CHAT, COMPLETIONS):
        return  # /tokenize and /detokenize: test_body_fuzz.py, over HTTP
    full = dataclasses.replace(limits(), context_length=FULL_CONTEXT)
    try:
        body = parse_body(case.encoded(), "application/json", 1 << 20)
        valid = validate_request("chat" if case.path == CHAT else "completion", body, full,
                                 encoder())
    except ApiError as exc:
        check_api_error(exc)
        assert exc.param is not None and top_level(exc.param) in case.fields, \
            (case.changed, exc.param, exc.message)
        return
    assert 1 <= valid.sampling.max_tokens <= 16
    valid.sampling.validate()
    assert set(valid.ignored) >= {name for name in case.body if name not in MODELS[case.path]
                                  .model_fields}
