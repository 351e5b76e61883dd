"""runtime/grammar.py: compiling response formats with llguidance and masking logits by them."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from runtime import grammar as grammar_module
from runtime.grammar import (
    GrammarCompiler,
    GrammarError,
    ResponseFormat,
    apply_masks,
    make_grammar_compiler,
    unpack_bitmask,
)
from runtime.model import EOS_ID, ModelBundle

PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def compiler(bundle: ModelBundle) -> GrammarCompiler:
    return make_grammar_compiler(bundle)


def schema_format(schema: object) -> ResponseFormat:
    return ResponseFormat("json_schema", schema, "test")  # type: ignore[arg-type]


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "objec"}, "'objec' is not a type: one of array, boolean, integer, null, number"),
    ({"$ref": "#/definitions/missing"}, "/definitions/missing"),
    ({"type": "string", "pattern": "("}, "unclosed group"),
    ({"type": "integer", "minimum": "a"}, "minimum"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
      "required": ["a"]}, "unsatisfiable"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
])
def test_a_schema_llguidance_refuses_is_an_error_naming_the_field_and_the_problem(
        compiler: GrammarCompiler, schema: dict[str, object], says: str) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(schema_format(schema))
    assert info.value.param == PARAM
    assert PARAM in str(info.value) and says in str(info.value)


def test_a_grammar_error_is_told_without_the_parser_state_and_grammar() -> None:
    # As llguidance words a matcher's failure: the state and the grammar (the client's whole
    # schema) came after it, hundreds of lines, into the client's error message.
    error = ('parser error: Too many items (limit 50000; ff_tokens)\n<state>\nTokens: ⟦{⟧\n'
             '</state><grammar>\n{"grammars":[{"json_schema":{"type":"object"}}]}\n</grammar>')
    assert grammar_module._readable(error) == "parser error: Too many items (limit 50000; " \
        "ff_tokens)"


NODE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": NODE}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/n"}},
     "required": ["a", "b"], "$defs": {"n": NODE}},
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"$defs": {"t": {"type": "object", "required": ["kids"], "properties": {"kids": {
        "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},  # a cycle and nothing else
])
def test_a_schema_no_finite_value_satisfies_is_refused(compiler: GrammarCompiler,
                                                       schema: dict[str, object]) -> None:
    # llguidance compiled these, then failed mid-output ("Too many items"): a 500.
    with pytest.raises(GrammarError, match="admits no finite value"):
        compiler.compile(ResponseFormat("json_schema", schema))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
     "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["x"]},
    {"type": "object", "properties": {"x": False}, "required": ["x"]},
    {"type": "array", "items": False, "minItems": 1},
])
def test_a_schema_no_value_satisfies_says_why_without_a_ref(compiler: GrammarCompiler,
                                                            schema: dict[str, object]) -> None:
    # Their message blamed a $ref loop the schema does not have.
    with pytest.raises(GrammarError, match="admits no value: a required property that its "
                       "object does not allow") as caught:
        compiler.compile(ResponseFormat("json_schema", schema))
    assert "$ref" not in str(caught.value)


@pytest.mark.parametrize(("schema", "where", "says"), [
    # Each was a 500 (the checks below llguidance read them as their types), or no response
    # at all (llguidance panicked cutting its message inside a character).
    ({"type": "string", "maxLength": "é" * 60}, "schema.maxLength", "is not of type 'integer'"),
    ({"type": "object", "required": 5}, "schema.required", "5 is not of type 'array'"),
    ({"properties": [1]}, "schema.properties", "[1] is not of type 'object'"),
    ({"allOf": 5}, "schema.allOf", "5 is not of type 'array'"),
    ({"type": "array", "prefixItems": 5, "minItems": 1}, "schema.prefixItems", "not of type"),
    ({"anyOf": [{"type": "string"}, {"required": [1]}]}, "schema.anyOf[1].required[0]",
     "1 is not of type 'string'"),
    ({"properties": {"a": {"minimum": "x"}}}, "schema.properties.a.minimum",
     "'x' is not of type 'number'"),
])
def test_a_keyword_of_the_wrong_type_is_named_by_its_path(compiler: GrammarCompiler,
                                                          schema: dict[str, object], where: str,
                                                          says: str) -> None:
    with pytest.raises(GrammarError) as caught:
        compiler.compile(ResponseFormat("json_schema", schema))
    assert f"`response_format.json_schema.{where}` is not valid JSON Schema: " in \
        str(caught.value) and says in str(caught.value)
    assert caught.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(("pattern", "count"), [("^a{1000000}$", "1,000,000"),
                                                ("^(a{1000}){1000}$", "1,000,000"),
                                                ("^(x|(ab){5000}){30}$", "150,000")])
def test_a_pattern_repeating_past_the_limit_is_refused(compiler: GrammarCompiler, pattern: str,
                                                       count: str) -> None:
    # llguidance compiled them and failed at the string's opening quote ("too many expressions
    # constructed"): a 500 for the request.
    for schema in ({"type": "string", "pattern": pattern},
                   {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}):
        with pytest.raises(GrammarError, match=f"repeats up to {count} times"):
            compiler.compile(ResponseFormat("json_schema", schema))


def test_patterns_within_the_limit_are_enforced(compiler: GrammarCompiler) -> None:
    for pattern in ("^a{100000}$", "^[a-z]{50000}$", "^(ab|cd){20000}$", "^\\d{4}-\\d{2}$"):
        matcher = compiler.compile(ResponseFormat("json_schema", {
            "type": "string", "pattern": pattern})).new_matcher()
        matcher.consume(ord('"'))  # where the refused ones failed
        matcher.check()


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {**NODE, "required": []}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},
    {"$defs": {"t": {"type": "object", "required": ["kids"], "properties": {"kids": {
        "type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
    {"$defs": {"l": {"anyOf": [{"type": "null"}, {
        "type": "object", "required": ["next"], "properties": {"next": {"$ref": "#/$defs/l"}}}]}},
     "$ref": "#/$defs/l"},
])
def test_recursive_schemas_with_a_way_out_compile(compiler: GrammarCompiler,
                                                  schema: dict[str, object]) -> None:
    compiler.compile(ResponseFormat("json_schema", schema))


def test_multiple_of_must_be_positive(compiler: GrammarCompiler) -> None:
    # JSON Schema's rule; llguidance refuses 0 but took -2 as 2.
    for schema, where in (({"type": "number", "multipleOf": -2}, "schema.multipleOf"),
                          ({"type": "object", "properties": {"n": {"multipleOf": -0.5}}},
                           "schema.properties.n.multipleOf")):
        with pytest.raises(GrammarError, match=f"{where}` is not valid JSON Schema: -[0-9.]+ is "
                           "less than or equal to the minimum of 0"):
            compiler.compile(ResponseFormat("json_schema", schema))
    # A property named multipleOf, and one in an enum's values, are no keyword.
    compiler.compile(ResponseFormat("json_schema", {
        "type": "object", "properties": {"multipleOf": {"type": "integer"}}}))
    compiler.compile(ResponseFormat("json_schema", {"enum": [{"multipleOf": -1}]}))


def test_a_schema_too_long_is_refused_before_compiling(compiler: GrammarCompiler) -> None:
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    with pytest.raises(GrammarError, match="longer than"):
        compiler.compile(schema_format(huge))


def allowed_tokens(compiler: GrammarCompiler, matcher: object, width: int) -> set[int]:
    logits = apply_masks(mx.zeros((1, width)), [matcher])  # type: ignore[list-item]
    return set(np.flatnonzero(np.isfinite(np.array(logits[0]))).tolist())


def test_the_mask_follows_the_grammar_and_allows_eos_only_when_it_accepts(
        compiler: GrammarCompiler, bundle: ModelBundle) -> None:
    width = compiler.vocab_size
    matcher = compiler.compile(ResponseFormat("json_object")).new_matcher()
    assert allowed_tokens(compiler, matcher, width) == {ord("{")}
    for token in b'{"a": [1, 2]':
        matcher.consume(token)
    after_array = allowed_tokens(compiler, matcher, width)
    assert ord("}") in after_array and ord(",") in after_array and EOS_ID not in after_array
    matcher.consume(ord("}"))
    assert matcher.accepting
    assert allowed_tokens(compiler, matcher, width) == {EOS_ID}
    matcher.consume(EOS_ID)


def test_rows_without_a_matcher_keep_their_logits(compiler: GrammarCompiler) -> None:
    width = compiler.vocab_size
    logits = mx.random.normal((3, width), key=mx.random.key(0))
    matcher = compiler.compile(ResponseFormat("json_object")).new_matcher()
    out = apply_masks(logits, [None, matcher, None])
    assert mx.array_equal(out[0], logits[0]) and mx.array_equal(out[2], logits[2])
    finite = np.flatnonzero(np.isfinite(np.array(out[1])))
    assert finite.tolist() == [ord("{")] and out[1, ord("{")].item() == logits[1, ord("{")].item()
    assert apply_masks(logits, [None, None, None]) is logits


def test_each_sequence_gets_its_own_matcher(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(ResponseFormat("json_object"))
    first, second = grammar.new_matcher(), grammar.new_matcher()
    first.consume(ord("{"))
    assert allowed_tokens(compiler, second, compiler.vocab_size) == {ord("{")}
    assert ord("{") not in allowed_tokens(compiler, first, compiler.vocab_size)


def test_a_refused_token_is_an_error_and_a_taken_one_rolls_back(
        compiler: GrammarCompiler) -> None:
    # A tick takes every row's token before it commits any, and rolls back the ones taken when
    # a later row's grammar fails (runtime/seq_state.py, advance_grammars).
    matcher = compiler.compile(ResponseFormat("json_object")).new_matcher()
    matcher.consume(ord("{"))
    assert allowed_tokens(compiler, matcher, compiler.vocab_size) != {ord("{")}
    matcher.rollback()
    assert allowed_tokens(compiler, matcher, compiler.vocab_size) == {ord("{")}
    matcher.consume(ord("{"))
    with pytest.raises(RuntimeError, match="refused token 65"):
        matcher.consume(ord("A"))


def test_unpack_bitmask_puts_bit_i_of_word_w_at_token_32w_plus_i() -> None:
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = np.int32(-2**31)  # bit 31 of word 2: token 95
    bitmask[1, 1] = 1
    out = np.array(unpack_bitmask(bitmask, 90))
    assert out.shape == (2, 90)
    assert np.flatnonzero(out[0]).tolist() == [5]  # token 95 is past the 90 columns
    assert np.flatnonzero(out[1]).tolist() == [32]


def test_compiled_schema_masks_out_everything_outside_its_enum(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"c": {"enum": ["DE", "FR"]}}, "required": ["c"],
              "additionalProperties": False}
    matcher = compiler.compile(schema_format(schema)).new_matcher()
    for token in b'{"c": "':
        matcher.consume(token)
    assert allowed_tokens(compiler, matcher, compiler.vocab_size) == {ord("D"), ord("F")}
    for token in json.dumps("FR")[1:].encode() + b"}":
        matcher.consume(token)
    assert matcher.accepting


@pytest.mark.parametrize("schema", [
    # Not strictly valid under the meta-schema the check reads (2020-12 without `$schema`), but
    # enforced by llguidance as clients mean them: they compiled before the meta-schema check,
    # and must still (the check only explains a schema llguidance refuses).
    {"type": "object", "properties": {"t": {"type": "array", "items": [
        {"type": "integer"}, {"type": "string"}], "minItems": 2, "maxItems": 2}},
     "required": ["t"]},
    {"type": "number", "minimum": 0, "exclusiveMinimum": True},
    {"type": "string", "title": 5, "description": None},
])
def test_schemas_llguidance_enforces_compile_though_not_strictly_valid(
        compiler: GrammarCompiler, schema: dict[str, object]) -> None:
    compiler.compile(ResponseFormat("json_schema", schema))


def test_a_non_string_schema_uri_is_no_crash(compiler: GrammarCompiler) -> None:
    # jsonschema's draft lookup raised on it (a 500); llguidance ignores it, and so do we.
    for declared in (5, ["a"], {"a": 1}):
        compiler.compile(ResponseFormat("json_schema", {"$schema": declared, "type": "object"}))
        with pytest.raises(GrammarError, match=r"schema\.required` is not valid JSON Schema"):
            compiler.compile(ResponseFormat("json_schema", {"$schema": declared,
                                                            "type": "object", "required": 5}))


def test_a_panic_in_the_grammar_engine_is_a_grammar_error(compiler: GrammarCompiler) -> None:
    # llguidance panics cutting its message inside a character; pyo3's PanicException is a
    # BaseException, which passed every `except Exception` (the connection dropped with no
    # response). A Lark grammar reaches llguidance without the meta-schema check.
    lark = "start: %json " + json.dumps({"type": "string", "maxLength": "é" * 60},
                                        ensure_ascii=False)
    with pytest.raises(GrammarError, match="`tools` cannot be enforced: the grammar engine "
                       "failed: end byte index 100 is not a char boundary"):
        compiler.compile_lark(lark, "tools", "tool_calls")
