import pytest

from statemachine.expr import ExprError, compile_expr

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
])
def test_rejects_with_a_reason(source, message):
    with pytest.raises(ExprError, match=message):
        compile_expr(source, NAMES)


def test_checks_the_result_kind():
    with pytest.raises(ExprError, match="expected a condition"):
        compile_expr("a + 1", NAMES, want="bool")


def test_division_by_zero_is_an_expression_error():
    with pytest.raises(ExprError, match="division by zero"):
        compile_expr("a // b", NAMES)({"a": 1, "b": 0})
