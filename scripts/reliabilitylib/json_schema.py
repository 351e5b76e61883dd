"""Hypothesis strategies for the values a JSON schema allows, for the keywords pydantic writes.

`from_json_schema(schema)` covers what `BaseModel.model_json_schema()` emits for the body models:
`$ref`/`$defs`, `anyOf`/`oneOf` (pydantic's members are told apart by their type or a `const`
tag, so a value of one member matches only it), `const`, `enum`, the JSON types with
`minimum`/`maximum`/`exclusiveMinimum`, `minLength`/`maxLength` or a `pattern`,
`minItems`/`maxItems`, `properties`/`required`/`additionalProperties`, `propertyNames`, one
`patternProperties` (pydantic's `dict` with constrained keys) and `maxProperties`. Any other
validation keyword is an error, so a model that starts using one is noticed rather than
half-generated.

Why not hypothesis-jsonschema: its 0.23.1 calls `many.more()`, which this project's Hypothesis
no longer has, and once adapted it rebuilds its strategies on every draw: 0.6-1.2 s per chat
body on this machine, against milliseconds here (ADR 0009).
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

# Keywords that only describe (or that pydantic adds for documentation): no effect on values.
ANNOTATIONS = frozenset({"title", "description", "default", "discriminator", "examples",
                         "$defs", "$schema"})
HANDLED = frozenset({"$ref", "anyOf", "oneOf", "const", "enum", "type", "minimum", "maximum",
                     "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                     "pattern", "minItems", "maxItems", "items", "properties", "required",
                     "additionalProperties", "maxProperties", "propertyNames",
                     "patternProperties"})
EXTRA_KEYS = st.text(max_size=8)
JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                        st.floats(allow_nan=False, allow_infinity=False))
ANY_JSON = st.recursive(JSON_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(EXTRA_KEYS, inner, max_size=3)), max_leaves=6)


def from_json_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid per `schema` (a root schema: its `$defs` are where `$ref`s point)."""
    return _strategy(schema, schema.get("$defs", {}))


def _strategy(schema: dict[str, Any] | bool, defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    if schema is True or schema == {}:
        return ANY_JSON
    assert isinstance(schema, dict), schema
    unknown = set(schema) - HANDLED - ANNOTATIONS
    if unknown:
        raise ValueError(f"JSON schema keywords {sorted(unknown)} are not generated here")
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return st.deferred(lambda: _strategy(defs[name], defs))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    members = schema.get("anyOf") or schema.get("oneOf")
    if members:
        return st.one_of([_strategy(member, defs) for member in members])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, defs)
    if kind == "array":
        return st.lists(_strategy(schema.get("items", True), defs),
                        min_size=schema.get("minItems", 0), max_size=schema.get("maxItems"))
    if kind == "string" and "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength"))
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    raise ValueError(f"JSON schema type {kind!r} is not generated here")


def _number(schema: dict[str, Any], integer: bool) -> st.SearchStrategy[Any]:
    low, high = schema.get("minimum"), schema.get("maximum")
    low_open, high_open = "exclusiveMinimum" in schema, "exclusiveMaximum" in schema
    low = schema.get("exclusiveMinimum", low)
    high = schema.get("exclusiveMaximum", high)
    if integer:
        return st.integers(None if low is None else math.floor(low) + low_open,
                           None if high is None else math.ceil(high) - high_open)
    # A JSON number may be written as an integer: both forms.
    floats = st.floats(low, high, exclude_min=low_open, exclude_max=high_open,
                       allow_nan=False, allow_infinity=False)
    ints = st.integers(None if low is None else math.ceil(low) + (low_open and low % 1 == 0),
                       None if high is None else math.floor(high) - (high_open and high % 1 == 0))
    return floats | ints


def _object(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    properties = {name: _strategy(sub, defs) for name, sub in schema.get("properties", {}).items()}
    required = set(schema.get("required", ()))
    declared = st.fixed_dictionaries(
        {name: s for name, s in properties.items() if name in required},
        optional={name: s for name, s in properties.items() if name not in required})
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return declared
    if "patternProperties" in schema:  # a `dict` whose keys match the one pattern
        [(pattern, sub)] = schema["patternProperties"].items()
        return st.dictionaries(st.from_regex(pattern, fullmatch=True), _strategy(sub, defs),
                               max_size=schema.get("maxProperties", 3))
    values = ANY_JSON if extra is True else _strategy(extra, defs)
    if not properties:  # a free-form object (`dict[str, X]`)
        names = _strategy({"type": "string", "maxLength": 8, **schema.get("propertyNames", {})},
                          defs)
        return st.dictionaries(names, values, max_size=schema.get("maxProperties"))
    # A model with a few keys it does not declare (ignored by the server, and named).
    keys = EXTRA_KEYS.filter(lambda key: key not in properties)
    return st.builds(lambda extras, own: {**extras, **own},
                     st.dictionaries(keys, values, max_size=2), declared)
