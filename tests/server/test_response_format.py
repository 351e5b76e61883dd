"""`response_format` read from chat and completions bodies (no engine): OpenAI's shapes, and a
400 naming the exact part that is wrong. Compiling the schema is tested through the routes."""

from __future__ import annotations

import pytest

from runtime.formats import ResponseFormat
from tests.server.test_validation import chat, completion, expect

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("call", [chat, completion])
def test_the_three_types(call):
    assert call(response_format={"type": "text"}).response_format is None
    assert call().response_format is None
    assert call(response_format={"type": "json_object"}).response_format == \
        ResponseFormat("json_object")
    got = call(response_format={"type": "json_schema", "json_schema": {
        "name": "thing_1", "schema": SCHEMA, "strict": True, "description": "a thing"}})
    assert got.response_format == ResponseFormat("json_schema", SCHEMA, "thing_1")
    lax = call(response_format={"type": "json_schema",
                                "json_schema": {"name": "t", "schema": SCHEMA, "strict": None}})
    assert lax.response_format == ResponseFormat("json_schema", SCHEMA, "t")


@pytest.mark.parametrize(("value", "param", "says"), [
    ("json", "response_format", 'whose `type` is one of "text"'),
    ({}, "response_format.type", 'is required: one of "text"'),
    ({"type": ["json_object"]}, "response_format.type", 'must be one of "text"'),
    ({"type": {"a": 1}}, "response_format.type", 'must be one of "text"'),
    ({"type": "json"}, "response_format.type", '"json_schema", got "json"'),
    ({"type": "json_schema"}, "response_format.json_schema", "is required: an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
     "response_format.json_schema.name", "is required"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
     "response_format.json_schema.name", "1 to 64 letters, digits"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}},
     "response_format.json_schema.name", "1 to 64"),
    ({"type": "json_schema", "json_schema": {"name": "t"}},
     "response_format.json_schema.schema", "is required: an object"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": True}},
     "response_format.json_schema.schema", "must be an object, got true"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict", "true or false"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "description": 1}},
     "response_format.json_schema.description", "string"),
])
@pytest.mark.parametrize("call", [chat, completion])
def test_a_bad_shape_is_a_400_naming_the_part(call, value, param, says):
    expect(call, response_format=value, param=param, match=says)


@pytest.mark.parametrize("call", [chat, completion])
def test_unknown_fields_inside_are_ignored_and_named(call):
    # As everywhere in a body (ADR 0010): ignored, and named in fairtick-ignored-fields.
    got = call(response_format={"type": "json_schema", "x": 1, "json_schema": {
        "name": "t", "schema": SCHEMA, "y": 2}})
    assert got.response_format == ResponseFormat("json_schema", SCHEMA, "t")
    assert got.ignored == ("response_format.x", "response_format.json_schema.y")


@pytest.mark.parametrize("field,value", [("min_tokens", 2), ("ignore_eos", True)])
def test_the_grammar_decides_the_end(field, value):
    expect(chat, response_format={"type": "json_object"}, **{field: value}, param=field,
           match="cannot be used with `response_format`")
    assert chat(**{field: value}).response_format is None  # alone, each is fine
