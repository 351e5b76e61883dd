"""A small, safe expression language for policy conditions, claims and sizes.

Expressions are Python-like: integers, `true`/`false`, names, `+ - * //`, comparisons (chainable),
`and`/`or`/`not`, `min(...)`/`max(...)`, parentheses. They are parsed once with the standard
`ast` module, checked for types (number vs boolean) against the names a spec may use, and
compiled into nested closures. Nothing is ever passed to `eval`.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["num", "bool"]
Env = Mapping[str, Any]
Fn = Callable[[Env], Any]


class ExprError(ValueError):
    """An expression that does not parse, names something unknown, or mixes types."""


@dataclass(frozen=True)
class Expr:
    """A compiled expression: `expr(env)` evaluates it over a mapping of names to values."""

    source: str
    kind: Kind
    names: frozenset[str]
    fn: Fn

    def __call__(self, env: Env) -> Any:
        return self.fn(env)


_ARITH: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: lambda a, b: a // b if b else _div_zero(),
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne,
}
_CALLS: dict[str, Callable[..., Any]] = {"min": min, "max": max}
_WORDS = {"true": True, "false": False}


def _div_zero() -> Any:
    raise ExprError("division by zero")


def compile_expr(source: str | int | float | bool, names: Mapping[str, Kind],
                 want: Kind | None = None) -> Expr:
    """Compile `source`; `names` maps each allowed name to its kind; `want` checks the result."""
    if isinstance(source, bool | int | float):
        text = str(source).lower() if isinstance(source, bool) else str(source)
    elif isinstance(source, str):
        text = source
    else:
        raise ExprError(f"expected an expression, got {type(source).__name__}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"cannot parse {text!r}: {exc.msg}") from exc
    used: set[str] = set()
    kind, fn = _compile(tree.body, names, used)
    if want is not None and kind != want:
        raise ExprError(f"{text!r} is a {_KIND_WORD[kind]}, expected a {_KIND_WORD[want]}")
    return Expr(text, kind, frozenset(used), fn)


_KIND_WORD = {"num": "number", "bool": "condition (true/false)"}


def _need(kind: Kind, got: Kind, node: ast.AST) -> None:
    if kind != got:
        raise ExprError(f"{ast.unparse(node)!r} is a {_KIND_WORD[got]}, "
                        f"expected a {_KIND_WORD[kind]}")


def _compile(node: ast.AST, names: Mapping[str, Kind], used: set[str]) -> tuple[Kind, Fn]:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        value = node.value
        return ("bool" if isinstance(value, bool) else "num"), (lambda env: value)
    if isinstance(node, ast.Name):
        return _compile_name(node.id, names, used)
    if isinstance(node, ast.BoolOp):
        parts = [_operand(v, "bool", names, used) for v in node.values]
        if isinstance(node.op, ast.And):
            return "bool", lambda env: all(p(env) for p in parts)
        return "bool", lambda env: any(p(env) for p in parts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _operand(node.operand, "bool", names, used)
        return "bool", lambda env: not inner(env)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _operand(node.operand, "num", names, used)
        return "num", lambda env: -inner(env)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        op = _ARITH[type(node.op)]
        left = _operand(node.left, "num", names, used)
        right = _operand(node.right, "num", names, used)
        return "num", lambda env: op(left(env), right(env))
    if isinstance(node, ast.Compare) and all(type(o) in _COMPARE for o in node.ops):
        return "bool", _compile_compare(node, names, used)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in _CALLS and not node.keywords and len(node.args) >= 2:
        call = _CALLS[node.func.id]
        args = [_operand(a, "num", names, used) for a in node.args]
        return "num", lambda env: call(a(env) for a in args)
    raise ExprError(f"{ast.unparse(node)!r} is not allowed: use numbers, names, + - * //, "
                    "comparisons, and/or/not, min(...), max(...)")


def _compile_name(name: str, names: Mapping[str, Kind], used: set[str]) -> tuple[Kind, Fn]:
    if name in _WORDS:
        value = _WORDS[name]
        return "bool", lambda env: value
    if name not in names:
        known = ", ".join(sorted(names))
        raise ExprError(f"unknown name {name!r}; known names: {known}")
    used.add(name)
    return names[name], operator.itemgetter(name)


def _operand(node: ast.AST, kind: Kind, names: Mapping[str, Kind], used: set[str]) -> Fn:
    got, fn = _compile(node, names, used)
    _need(kind, got, node)
    return fn


def _compile_compare(node: ast.Compare, names: Mapping[str, Kind], used: set[str]) -> Fn:
    terms = [_operand(t, "num", names, used) for t in (node.left, *node.comparators)]
    ops = [_COMPARE[type(o)] for o in node.ops]
    if len(ops) == 1:
        op, left, right = ops[0], terms[0], terms[1]
        return lambda env: op(left(env), right(env))

    def chained(env: Env) -> bool:
        values = [t(env) for t in terms]
        return all(op(a, b) for op, a, b in zip(ops, values, values[1:], strict=False))

    return chained
