"""Request bodies without an engine: size, content type, encoding, JSON syntax and depth."""

from __future__ import annotations

import json

import pytest

from server.validation import MAX_JSON_DEPTH, parse_body
from tests.server.test_validation import expect


def test_a_valid_body_parses():
    assert parse_body(b'{"prompt": "hi"}', "application/json; charset=utf-8", 1024) == {
        "prompt": "hi"}


def test_body_too_large_is_413():
    # The same code as the 413 answered from Content-Length before the body is read (it was
    # `request_too_large` here, `payload_too_large` there: two refusal reasons in /metrics).
    err = expect(parse_body, b"{}" + b" " * 2000, "application/json", 1024, status=413,
                 match="limit is 1024 (--max-body-bytes)")
    assert err.to_body()["error"]["code"] == "payload_too_large"


def test_a_utf8_byte_order_mark_is_ignored():
    # RFC 8259 lets a parser ignore it, and some Windows clients send it: it was a 400 whose
    # message told the client to "decode using utf-8-sig".
    assert parse_body(b'\xef\xbb\xbf{"prompt": "hi"}', "application/json", 1024) == \
        {"prompt": "hi"}


@pytest.mark.parametrize("coding", ["gzip", "br", " GZIP "])
def test_a_compressed_body_is_415(coding):
    # A gzip body was read as JSON (400 "not valid UTF-8") and a plain one labelled br was
    # taken: the server decodes no content coding.
    expect(parse_body, b'{"prompt": "hi"}', "application/json", 1024, coding,
           status=415, match="send the body uncompressed")
    assert parse_body(b'{"prompt": "hi"}', "application/json", 1024, "identity") == \
        {"prompt": "hi"}


def test_wrong_content_type_is_415():
    expect(parse_body, b"prompt=hi", "application/x-www-form-urlencoded", 1024, status=415,
           match="application/json")


def test_empty_body():
    expect(parse_body, b"  ", "application/json", 1024, match="empty")


def test_invalid_utf8():
    err = expect(parse_body, b'{"prompt": "\xff\xfe"}', "application/json", 1024,
                 match="not valid UTF-8")
    assert err.code == "invalid_encoding"


def test_malformed_json():
    err = expect(parse_body, b'{"prompt": "hi",}', "application/json", 1024,
                 match="not valid JSON")
    assert err.code == "invalid_json"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_json_constants_name_where_they_are(literal):
    expect(parse_body, f'{{"temperature": {literal}}}'.encode(), "application/json", 1024,
           param="temperature", match=f"got {literal}")
    expect(parse_body, f'{{"stream_options": {{"x": [1, {literal}]}}}}'.encode(), None, 1024,
           param="stream_options.x[1]", match="finite number")


def test_a_non_finite_number_under_an_empty_key_names_that_key():
    # A field called "" is a field, not the body: the error names it (a fuzzed body found this).
    expect(parse_body, b'{"": NaN, "messages": []}', None, 1024, param="",
                 match='`""` must be a finite number, got NaN')
    expect(parse_body, b'{"a": {"": [Infinity]}}', None, 1024, param="a.[0]",
           match="`a.[0]` must be a finite number")


def test_a_float_literal_past_the_float_range_is_refused():
    expect(parse_body, b'{"logit_bias": {"5": -1e400}}', None, 1024, param="logit_bias.5",
           match="got -Infinity")
    expect(parse_body, b"1e999", None, 1024, param=None, match="`body` must be a finite")


def test_huge_integer_literal():
    expect(parse_body, b'{"max_tokens": 1' + b"0" * 5000 + b"}", None, 10_000,
           match="not valid JSON")


def test_deeply_nested_json():
    body = json.dumps({"prompt": "hi", "user": [[[[]]]] * 1}).encode()
    assert parse_body(body, None, 1024) == json.loads(body)
    deep = b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    expect(parse_body, deep, None, 10_000, match="nested deeper")


def test_pathologically_nested_json():
    expect(parse_body, b"[" * 100_000 + b"]" * 100_000, None, 1_000_000)


def test_lone_surrogate_escape():
    err = expect(parse_body, b'{"prompt": "\\ud800"}', None, 1024, match="surrogate")
    assert err.code == "invalid_encoding"


def test_body_must_be_an_object():
    expect(parse_body, b'["hi"]', None, 1024, match="JSON object")
