"""A small, safe expression language for policy conditions, claims and sizes.

Expressions are Python-like: integers, `true`/`false`, names, `+ - * //`, comparisons (chainable),
`and`/`or`/`not`, `min(...)`/`max(...)`, parentheses. They are parsed once with the standard
`ast` module, checked for types (number vs boolean) against the names a spec may use, and
compiled into nested closures. Nothing is ever passed to `eval`.

Every check is made at load, before anything runs: an expression is at most `MAX_CHARS`
characters and nests at most `MAX_DEPTH` levels (so no step recurses past Python's limit), and
each name carries the range of its values (`Var`), so that a division by something that can be
0 is refused (a small interval analysis, exact over rationals).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from statemachine.yamlsrc import excerpt

Kind = Literal["num", "bool"]
Env = Mapping[str, Any]
Fn = Callable[[Env], Any]
Bound = Fraction | float  # a float bound is always -inf or inf

MAX_CHARS = 1000  # the shipped expressions have at most 72
MAX_DEPTH = 32  # subexpression levels; the shipped expressions use at most 7


class ExprError(ValueError):
    """An expression that does not parse, names something unknown, or mixes types."""


@dataclass(frozen=True)
class Var:
    """A name an expression may read: its kind and, for a number, the range of its values.
    The range is what lets `x // name` be accepted (it cannot be 0) or refused (it can)."""

    kind: Kind = "num"
    low: int | float = -math.inf
    high: int | float = math.inf

    def __post_init__(self) -> None:
        if not self.low <= self.high:  # also refuses nan
            raise ValueError(f"Var range [{self.low}, {self.high}] is empty")


@dataclass(frozen=True)
class Expr:
    """A compiled expression: `expr(env)` evaluates it over a mapping of names to values.
    `tree` is the checked syntax tree, for analyses that walk the expression; a number's values
    lie in [low, high] while its names' stay in their ranges."""

    source: str
    kind: Kind
    names: frozenset[str]
    fn: Fn
    tree: ast.expr
    low: Bound = -math.inf
    high: Bound = math.inf

    def __call__(self, env: Env) -> Any:
        return self.fn(env)


@dataclass(frozen=True)
class _Part:
    """A compiled subexpression, with the range of values it can take when it is a number."""

    kind: Kind
    fn: Fn
    low: Bound = -math.inf
    high: Bound = math.inf


_ARITH: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    # Unreachable for values inside their declared ranges; a value outside still gets a reason.
    ast.FloorDiv: lambda a, b: a // b if b else _div_zero(),
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne,
}
_CALLS: dict[str, Callable[..., Any]] = {"min": min, "max": max}
_WORDS = {"true": True, "false": False}
_KIND_WORD = {"num": "number", "bool": "condition (true/false)"}


def _div_zero() -> Any:
    raise ExprError("division by zero: a value is outside the range declared for its name")


def compile_expr(source: str | int | float | bool, names: Mapping[str, Var | Kind],
                 want: Kind | None = None) -> Expr:
    """Compile `source`; `names` maps each allowed name to its `Var` (or just its kind, for a
    number of unknown range); `want` checks the result's kind."""
    if isinstance(source, bool | int | float):
        text = str(source).lower() if isinstance(source, bool) else str(source)
    elif isinstance(source, str):
        text = source
    else:
        raise ExprError(f"expected an expression, got {type(source).__name__}")
    tree = _parse(text)
    scope = {n: v if isinstance(v, Var) else Var(v) for n, v in names.items()}
    used: set[str] = set()
    part = _compile(tree, scope, used)
    if want is not None and part.kind != want:
        raise ExprError(f"{_quote(text)} is a {_KIND_WORD[part.kind]}, expected a "
                        f"{_KIND_WORD[want]}")
    return Expr(text, part.kind, frozenset(used), part.fn, tree, part.low, part.high)


def _quote(text: str) -> str:
    return repr(excerpt(text))


def _parse(text: str) -> ast.expr:
    """The syntax tree of `text`, refused before any recursive step if too long or deep."""
    text = text.strip()
    if len(text) > MAX_CHARS:
        raise ExprError(f"{_quote(text)} is {len(text)} characters long; an expression may "
                        f"have at most {MAX_CHARS}")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise ExprError(f"cannot parse {_quote(text)}: {exc.msg}") from exc
    except (RecursionError, MemoryError) as exc:
        raise ExprError(f"cannot parse {_quote(text)}: nested too deeply (at most "
                        f"{MAX_DEPTH} levels)") from exc
    except ValueError as exc:  # a NUL character (Python 3.11)
        raise ExprError(f"cannot parse {_quote(text)}: {exc}") from exc
    # Iterative: the tree may be far deeper than the recursion limit. Every node is visited;
    # only subexpressions count as levels (not operators, contexts or keywords).
    stack: list[tuple[ast.AST, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ExprError(f"{_quote(text)} nests more than {MAX_DEPTH} levels deep; "
                            "simplify it (a policy expression needs fewer than 10)")
        stack.extend((child, depth + isinstance(child, ast.expr))
                     for child in ast.iter_child_nodes(node))
    return tree


def _compile(node: ast.AST, names: Mapping[str, Var], used: set[str]) -> _Part:
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        truth = node.value
        return _Part("bool", lambda env: truth)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        value, bound = node.value, _bound(node.value)
        return _Part("num", lambda env: value, bound, bound)
    if isinstance(node, ast.Name):
        return _compile_name(node.id, names, used)
    if isinstance(node, ast.BoolOp):
        fns = [_operand(v, "bool", names, used).fn for v in node.values]
        if isinstance(node.op, ast.And):
            return _Part("bool", lambda env: all(f(env) for f in fns))
        return _Part("bool", lambda env: any(f(env) for f in fns))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _operand(node.operand, "bool", names, used).fn
        return _Part("bool", lambda env: not inner(env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        part = _operand(node.operand, "num", names, used)
        neg = part.fn
        return _Part("num", lambda env: -neg(env), -part.high, -part.low)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        return _compile_arith(node, names, used)
    if isinstance(node, ast.Compare) and all(type(o) in _COMPARE for o in node.ops):
        return _Part("bool", _compile_compare(node, names, used))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in _CALLS and not node.keywords and len(node.args) >= 2:
        call = _CALLS[node.func.id]
        parts = [_operand(a, "num", names, used) for a in node.args]
        fns = [p.fn for p in parts]
        return _Part("num", lambda env: call(f(env) for f in fns),
                     call(p.low for p in parts), call(p.high for p in parts))
    raise ExprError(f"{_quote(ast.unparse(node))} is not allowed: use numbers, names, "
                    "+ - * //, comparisons, and/or/not, min(...), max(...)")


def _compile_name(name: str, names: Mapping[str, Var], used: set[str]) -> _Part:
    if name in _WORDS:
        value = _WORDS[name]
        return _Part("bool", lambda env: value)
    if name not in names:
        known = ", ".join(sorted(names))
        raise ExprError(f"unknown name {name!r}; known names: {known}")
    used.add(name)
    var = names[name]
    return _Part(var.kind, operator.itemgetter(name), _bound(var.low), _bound(var.high))


def _operand(node: ast.AST, kind: Kind, names: Mapping[str, Var], used: set[str]) -> _Part:
    part = _compile(node, names, used)
    if part.kind != kind:
        raise ExprError(f"{_quote(ast.unparse(node))} is a {_KIND_WORD[part.kind]}, "
                        f"expected a {_KIND_WORD[kind]}")
    return part


def _compile_arith(node: ast.BinOp, names: Mapping[str, Var], used: set[str]) -> _Part:
    a = _operand(node.left, "num", names, used)
    b = _operand(node.right, "num", names, used)
    if isinstance(node.op, ast.Add):
        low, high = _add(a.low, b.low), _add(a.high, b.high)
    elif isinstance(node.op, ast.Sub):
        low, high = _add(a.low, -b.high), _add(a.high, -b.low)
    elif isinstance(node.op, ast.Mult):
        low, high = _corners(_mul, a, b)
    else:
        if b.low <= 0 <= b.high:
            raise ExprError(_zero_divisor(node, b))
        low, high = _corners(_div, a, b)
        low, high = _floor(low), _floor(high)
    op, left, right = _ARITH[type(node.op)], a.fn, b.fn
    return _Part("num", lambda env: op(left(env), right(env)), low, high)


def _zero_divisor(node: ast.BinOp, divisor: _Part) -> str:
    whole = _quote(ast.unparse(node))
    if divisor.low == divisor.high == 0:
        return f"{whole} divides by zero"
    text = excerpt(ast.unparse(node.right), 40)
    return (f"{text!r} can be 0 (it ranges over "
            f"[{show_bound(divisor.low)}, {show_bound(divisor.high)}]), "
            f"so {whole} could divide by zero; divide by something that cannot be 0, e.g. "
            f"max(1, {text})")


def _compile_compare(node: ast.Compare, names: Mapping[str, Var], used: set[str]) -> Fn:
    terms = [_operand(t, "num", names, used).fn for t in (node.left, *node.comparators)]
    ops = [_COMPARE[type(o)] for o in node.ops]
    if len(ops) == 1:
        op, left, right = ops[0], terms[0], terms[1]
        return lambda env: op(left(env), right(env))

    def chained(env: Env) -> bool:
        values = [t(env) for t in terms]
        return all(op(a, b) for op, a, b in zip(ops, values, values[1:], strict=False))

    return chained


# -- interval arithmetic: finite bounds are exact Fractions, infinite ones are float inf ------

def _bound(value: int | float) -> Bound:
    return value if isinstance(value, float) and math.isinf(value) else Fraction(value)


def _add(x: Bound, y: Bound) -> Bound:
    # Never inf + -inf: a low bound is never inf, a high bound never -inf.
    return x if isinstance(x, float) else y if isinstance(y, float) else x + y


def _signed_inf(x: Bound, y: Bound) -> float:
    return math.inf if (x > 0) == (y > 0) else -math.inf


def _mul(x: Bound, y: Bound) -> tuple[Bound, ...]:
    if x == 0 or y == 0:
        return (Fraction(0),)
    if isinstance(x, float) or isinstance(y, float):
        return (_signed_inf(x, y),)
    return (x * y,)


def _div(x: Bound, y: Bound) -> tuple[Bound, ...]:
    # y is never 0 here. Near an (inf, inf) corner x / y takes every value of its sign.
    if isinstance(y, float):
        return (Fraction(0), _signed_inf(x, y)) if isinstance(x, float) else (Fraction(0),)
    if isinstance(x, float):
        return (_signed_inf(x, y),)
    return (x / y,)


def _corners(op: Callable[[Bound, Bound], tuple[Bound, ...]], a: _Part,
             b: _Part) -> tuple[Bound, Bound]:
    # Product and quotient are monotone in each argument over a box without a zero divisor,
    # so their extremes lie at the corners (or are approached there).
    values = [v for x in (a.low, a.high) for y in (b.low, b.high) for v in op(x, y)]
    return min(values), max(values)


def _floor(x: Bound) -> Bound:
    return x if isinstance(x, float) else Fraction(math.floor(x))


def show_bound(x: Bound) -> str:
    """An interval's bound as an error message writes it."""
    if isinstance(x, float):
        return "-inf" if x < 0 else "inf"
    if x.denominator == 1 and abs(x) < 10**15:
        return str(x.numerator)
    return f"{float(x):g}" if abs(x) < 10**300 else "-huge" if x < 0 else "huge"
