import ast
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine.expr import MAX_CHARS, MAX_DEPTH, ExprError, Var, compile_expr
from statemachine.spec import STATE_FIELDS

NAMES = {"a": "num", "b": "num"}


@pytest.mark.parametrize(("source", "env", "expected"), [
    ("a + b * 2", {"a": 1, "b": 3}, 7),
    ("(a + b) // 2", {"a": 3, "b": 4}, 3),
    ("min(a, b, 5) - max(a, 1)", {"a": 2, "b": 9}, 0),
    ("-a + 1", {"a": 4}, -3),
    ("a > 1 and not b >= 3 or false", {"a": 2, "b": 2}, True),
    ("1 <= a < b", {"a": 1, "b": 2}, True),
    ("1 <= a < b", {"a": 2, "b": 2}, False),
    (True, {}, True),
    (7, {}, 7),
])
def test_evaluates(source, env, expected):
    assert compile_expr(source, NAMES)(env) == expected


def test_records_the_names_it_reads():
    assert compile_expr("a > 1 or true", NAMES).names == {"a"}


def test_keeps_the_checked_tree_for_later_analyses():
    expr = compile_expr(" max(a, 1) >= b ", NAMES)
    assert isinstance(expr.tree, ast.Compare)
    assert ast.unparse(expr.tree) == "max(a, 1) >= b"


@pytest.mark.parametrize(("source", "message"), [
    ("a +", "cannot parse"),
    ("c > 1", "unknown name 'c'"),
    ("a and b", "expected a condition"),
    ("(a > 1) + 2", "expected a number"),
    ("__import__('os').system('true')", "not allowed"),
    ("a.real", "not allowed"),
    ("a / 2", "not allowed"),
    ("[a]", "not allowed"),
    ("abs(a)", "not allowed"),
    ("'text'", "not allowed"),
    ("a\x00", "cannot parse"),
])
def test_rejects_with_a_reason(source, message):
    with pytest.raises(ExprError, match=message):
        compile_expr(source, NAMES)


def test_checks_the_result_kind():
    with pytest.raises(ExprError, match="expected a condition"):
        compile_expr("a + 1", NAMES, want="bool")


# -- limits: refused before anything recursive, quoting only the start -----------------------

def refused(source: str, names=NAMES) -> str:
    with pytest.raises(ExprError) as info:
        compile_expr(source, names)
    return str(info.value)


@pytest.mark.parametrize(("source", "start"), [
    ("not " * 3000 + "true", "'not not not not not not not not not not not not not not not …'"),
    (" + ".join(["1"] * 2000), "'1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + …'"),
    ("(" * 2000 + "a" + ")" * 2000, "'" + "(" * 60 + "…'"),
])
def test_an_over_long_expression_is_refused_quoting_its_start(source, start):
    message = refused(source)
    assert message.startswith(start)
    assert f"is {len(source)} characters long; an expression may have at most {MAX_CHARS}" \
        in message
    assert len(message) < 200  # never the whole expression


@pytest.mark.parametrize("source", [
    "not " * 240 + "true",  # each within MAX_CHARS, each far deeper than MAX_DEPTH
    " + ".join(["a"] * 200),
    "-" * 900 + "a",
    "max(" * 100 + "a" + ", 1)" * 100,
])
def test_an_over_deep_expression_is_refused_quoting_its_start(source):
    assert len(source) <= MAX_CHARS
    message = refused(source)
    assert f"nests more than {MAX_DEPTH} levels deep" in message
    assert message.startswith(repr(source[:60] + "…"))


def test_the_depth_limit_is_exact():
    # `not` nested n times is n + 1 levels: the innermost operand is one more.
    assert compile_expr("not " * (MAX_DEPTH - 1) + "true", NAMES).kind == "bool"
    assert "nests more than" in refused("not " * MAX_DEPTH + "true")


def test_an_error_inside_quotes_a_short_excerpt_of_the_part():
    message = refused("b > 1 and not (" + " + ".join(["a"] * 30) + ")")
    first_60_chars = "a + " * 15
    assert message == f"'{first_60_chars}…' is a number, expected a condition (true/false)"


# -- division: refused at load unless the divisor cannot be 0 ---------------------------------

def test_a_divisor_that_can_be_zero_is_refused_with_a_fix():
    message = refused("10 // num_parked > 1", STATE_FIELDS)
    assert message == ("'num_parked' can be 0 (it ranges over [0, inf]), so '10 // num_parked' "
                       "could divide by zero; divide by something that cannot be 0, e.g. "
                       "max(1, num_parked)")


@pytest.mark.parametrize("source", [
    "10 // num_parked",
    "num_parked > 0 and 10 // num_parked > 1",  # conditions are not read: write max(1, ...)
    "chunk_size // (max_running - 1)",
    "chunk_size // (max_running - num_parked)",
    "chunk_size // min(max_running, num_waiting)",
    "chunk_size // (max_running // 2)",
    "chunk_size // (max_running * num_decoding)",
    "chunk_size // -num_parked",
    "chunk_size // 0",
    "chunk_size // (budget_tokens // chunk_size)",
])
def test_divisions_that_can_divide_by_zero_are_refused(source):
    assert "divide" in refused(source, STATE_FIELDS)


@pytest.mark.parametrize(("source", "env", "expected"), [
    ("10 // max_running", {"max_running": 4}, 2),
    ("10 // max(1, num_parked)", {"num_parked": 0}, 10),
    ("10 // (num_parked + 1)", {"num_parked": 0}, 10),
    ("num_waiting // 2", {"num_waiting": 5}, 2),
    ("10 // (max_running * chunk_size)", {"max_running": 2, "chunk_size": 2}, 2),
    ("10 // (2 * max_running - 1)", {"max_running": 1}, 10),
    ("10 // -max_running", {"max_running": 3}, -4),
    ("10 // max(num_parked, chunk_size // 2, 1)", {"num_parked": 0, "chunk_size": 1}, 10),
    ("10 // 0.5", {}, 20.0),
])
def test_divisions_by_what_cannot_be_zero_pass(source, env, expected):
    assert compile_expr(source, STATE_FIELDS)(env) == expected


def test_a_parameter_divides_when_its_range_excludes_zero():
    assert compile_expr("12 // every", {"every": Var("num", 1, 10)})({"every": 5}) == 2
    message = refused("12 // every", {"every": Var("num", 0, 10)})
    assert "'every' can be 0 (it ranges over [0, 10])" in message
    assert "can be 0 (it ranges over [-inf, inf])" in refused("a // b")  # a bare kind: any


def test_a_value_outside_its_declared_range_is_still_an_expression_error():
    expr = compile_expr("a // b", {"a": "num", "b": Var(low=1)})
    with pytest.raises(ExprError, match="outside the range declared"):
        expr({"a": 1, "b": 0})


def test_an_empty_range_is_a_programming_error():
    with pytest.raises(ValueError, match="empty"):
        Var("num", 2, 1)


# Soundness of the division check, over small integer boxes: an accepted expression never
# divides by zero at any point of its names' ranges.
BOX = {"p": Var("num", 0, 3), "q": Var("num", 1, 3), "r": Var("num", -2, 2),
       "s": Var("num", -3, -1)}
leaves = st.sampled_from(sorted(BOX)) | st.integers(-3, 3).map(str)
terms = st.recursive(leaves, lambda inner: st.one_of(
    st.tuples(inner, st.sampled_from(["+", "-", "*", "//"]), inner).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"),
    st.tuples(st.sampled_from(["min", "max"]), inner, inner).map(
        lambda t: f"{t[0]}({t[1]}, {t[2]})"),
    inner.map(lambda t: f"-{t}"),
), max_leaves=6)


@settings(max_examples=300, deadline=None, database=None, print_blob=True)
@given(numerator=terms, divisor=terms)
def test_an_accepted_division_never_divides_by_zero(numerator, divisor):
    try:
        expr = compile_expr(f"{numerator} // {divisor}", BOX)
    except ExprError:
        return
    names = sorted(BOX)
    for values in itertools.product(*(range(int(BOX[n].low), int(BOX[n].high) + 1)
                                      for n in names)):
        expr(dict(zip(names, values, strict=True)))  # raises ExprError on a zero divisor
