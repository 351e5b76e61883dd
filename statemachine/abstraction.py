"""What the exhaustive checker may abstract, computed from the spec, and where it refuses.

A checker that caps a counter below a threshold a rule compares it with, or fixes an input a
rule reads, proves claims the running scheduler breaks. So everything here is derived from the
policy's expressions:

- counters (`max_wait_ticks`, `decode_streak`, `decode_wait_ticks`) saturate at a cap above
  every constant they are compared with and one past their claimed bound; a counter may only be
  compared directly with a constant (anything else is refused: the cap would not be exact);
- inputs (`chunk_size`, `budget_tokens`) are explored over values below, at and above every
  constant they are compared with (and each other);
- counts (`num_parked`, ...) must be able to exceed every constant they are compared with in
  the explored layout, or the check is refused with the layout it needs.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from statemachine.expr import compile_expr
from statemachine.invariants import Bounds
from statemachine.tick import Policy

COUNTERS = ("max_wait_ticks", "decode_streak", "decode_wait_ticks")
COUNTS = ("num_running", "num_waiting", "num_parked", "num_decoding", "num_paused")
MAX_CHUNK_SIZE = 8  # prompts of max_chunks * chunk_size tokens: larger is out of reach
MAX_BUDGET = 16


class CannotCheck(ValueError):
    """The checker cannot be exact for this spec and layout: the reason, and what would do."""


@dataclass(frozen=True)
class Abstraction:
    """How one policy is explored: input domains and counter caps (0: not tracked)."""

    progress: bool  # prefill progress is tracked; else any grant may be a prompt's last
    sort_parked: bool  # parked prompts kept in wait order (ties in arrival order)
    rank_waits: bool  # the policy sees waits only through that order: unobserved ones are ranks
    chunk_sizes: tuple[int, ...]
    budgets: Mapping[int, tuple[int, ...]]  # per chunk size; empty: budget_tokens = chunk_size
    wait_cap: int
    wait_visible: bool  # the policy reads every parked prompt's wait (else: the observed one's)
    streak_cap: int
    dwait_cap: int
    overtaken_cap: int
    overtakes_follow: bool  # the overtakes claim follows from the pick rule (see analyse)
    queue_cap: int
    preemptions_cap: int
    age_cap: int
    grants_cap: int


def analyse(policy: Policy, bounds_for: Callable[[int], Bounds], max_running: int,
            max_seqs: int, kv_budget: int | None, horizon: int) -> Abstraction:
    """The abstraction for `policy` in a layout (`bounds_for(chunk)`: its claims for prompts
    of that chunk size); CannotCheck when none is exact."""
    spec = policy.spec
    # Prefill progress is only visible to a fewest_left pick and to KV accounting. Without
    # them, whether a grant ends a prompt is the environment's choice (prompts of any length),
    # and the size of a slice (chunk_tokens) cannot matter.
    progress = kv_budget is not None or spec.pick == "fewest_left"
    sized = progress and spec.chunk_tokens.source.strip() != "chunk_size"
    exprs = [(f"rule {r.name}", r.when.source) for r in spec.rules] + \
        [("grants", spec.grants.source)] + \
        ([("chunk_tokens", spec.chunk_tokens.source)] if sized else [])
    consts = {**policy.params, "max_running": max_running}
    reads = set().union(*(r.when.names for r in spec.rules), spec.grants.names,
                        spec.chunk_tokens.names if sized else set())
    chunk_sizes = _chunk_sizes(exprs, consts, reads)
    budgets = {c: _budgets(exprs, {**consts, "chunk_size": c})
               for c in chunk_sizes} if spec.tick_budget_ms is not None and \
        "budget_tokens" in reads else {}
    envs = [{**consts, "chunk_size": c, "budget_tokens": b}
            for c in chunk_sizes for b in budgets.get(c, (c,))]
    tops = _thresholds(exprs, envs)
    # Admission takes every arrival that fits: only the layout's overflow waits at a tick.
    _check_counts(tops, max_running, max_seqs,
                  max_seqs - (max_running if kv_budget is None else 1))
    every = [bounds_for(c) for c in chunk_sizes]
    b = every[-1]  # the largest chunk size: the loosest claims, hence the largest caps
    implied = {k: all(x.implied[k] for x in every) for k in b.implied}
    wait_visible = "max_wait_ticks" in reads or spec.pick == "round_robin"
    wait_cap = b.wait_ticks + 1 if b.wait_ticks is not None else horizon
    if wait_visible:
        wait_cap = max(wait_cap, tops.get("max_wait_ticks", -1) + 1)
    dwait_cap = b.decode_wait_ticks + 1 if b.decode_wait_ticks is not None else 0
    ttfts = [t for t in b.ttft_by_grants[1:] if t is not None]
    ages = ([b.first_grant_ticks] if not implied["first_grant_ticks"] and
            b.first_grant_ticks is not None else []) + \
        (ttfts if not implied["ttft_ticks"] else [])
    # Least recently served first, one grant a tick, nothing readmitted: a granted prompt
    # falls below every prompt still parked, and an admitted one joins below them, so only
    # the prompts ahead of a prompt when it (re)parked can pass it, each once.
    one_by_one = spec.pick == "round_robin" and spec.grants.source.strip() == "1"
    no_readmit = kv_budget is None or spec.kv_full == "queue"
    follow = one_by_one and no_readmit and b.overtakes is not None and \
        b.overtakes >= min(max_running, max_seqs) - 1
    return Abstraction(
        progress=progress,
        # In wait order, only ties need arrival order, and with one grant a tick ties only
        # arise between prompts admitted together (kept in arrival order by a stable sort).
        sort_parked=one_by_one,
        rank_waits=one_by_one and "max_wait_ticks" not in reads,
        chunk_sizes=chunk_sizes, budgets=budgets, wait_cap=wait_cap, wait_visible=wait_visible,
        streak_cap=tops.get("decode_streak", -1) + 1,
        dwait_cap=max(dwait_cap, tops.get("decode_wait_ticks", -1) + 1),
        overtaken_cap=0 if follow else _cap(b.overtakes), overtakes_follow=follow,
        queue_cap=_cap(b.queue_ticks),
        preemptions_cap=_cap(b.preemptions), age_cap=max(ages, default=-1) + 1,
        grants_cap=len(b.ttft_by_grants) if not implied["ttft_ticks"] else 0,
    )


def _cap(bound: int | None) -> int:
    return 0 if bound is None else bound + 1


def _pairs(tree: ast.AST) -> Iterator[tuple[ast.expr, ast.expr, ast.AST]]:
    # Every pair of operands the expression compares (min and max compare their arguments).
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            terms = [node.left, *node.comparators]
            yield from ((a, c, node) for a, c in zip(terms, terms[1:], strict=False))
        elif isinstance(node, ast.Call):
            yield from ((a, c, node) for a, c in itertools.combinations(node.args, 2))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _value(node: ast.expr, env: Mapping[str, int | float]) -> int:
    fn = compile_expr(ast.unparse(node), {k: "num" for k in env}, "num")
    return int(fn(env))


def _constant_side(a: ast.expr, c: ast.expr, consts: set[str]) -> ast.expr | None:
    # The side of a comparison that holds only constants, when the other holds something else.
    if _names(c) <= consts and not _names(a) <= consts:
        return c
    if _names(a) <= consts and not _names(c) <= consts:
        return a
    return None


def _chunk_sizes(exprs: list[tuple[str, str]], consts: Mapping[str, int | float],
                 reads: set[str]) -> tuple[int, ...]:
    if not reads & {"chunk_size", "budget_tokens"}:
        return (1,)  # every grant is one whole chunk: a chunk of one token is exact
    found = _met(exprs, consts, "chunk_size", MAX_CHUNK_SIZE, "chunks")
    return tuple(sorted({1, 2} | {max(1, v) for k in found for v in (k - 1, k, k + 1)}))


def _budgets(exprs: list[tuple[str, str]], consts: Mapping[str, int | float]) -> tuple[int, ...]:
    # budget_tokens below, at and above every constant (chunk_size included) it meets.
    found = _met(exprs, consts, "budget_tokens", MAX_BUDGET, "budgets")
    return tuple(sorted({0} | {v for k in found for v in (k - 1, k, k + 1) if v >= 0}))


def _met(exprs: list[tuple[str, str]], consts: Mapping[str, int | float], name: str,
         most: int, what: str) -> set[int]:
    # The constants `name` is compared with; one past the most the checker can explore: refuse.
    found = set()
    for where, source in exprs:
        for a, c, _ in _pairs(ast.parse(source, mode="eval")):
            side = _constant_side(a, c, set(consts))
            if side is not None and name in _names(c if side is a else a):
                k = _value(side, consts)
                if k + 1 > most:
                    raise CannotCheck(f"{where} compares {name} with {k}: exploring {what} "
                                      f"of more than {most} tokens is out of reach")
                found.add(k)
    return found


def _thresholds(exprs: list[tuple[str, str]],
                envs: list[dict[str, int | float]]) -> dict[str, int]:
    # For each counter and count: the largest constant it is compared with. A counter anywhere
    # but directly in a comparison with a constant cannot be capped exactly: refuse.
    consts = set(envs[0])
    tops: dict[str, int] = {}
    for where, source in exprs:
        tree = ast.parse(source, mode="eval")
        direct = {id(n) for a, c, node in _pairs(tree) if isinstance(node, ast.Compare)
                  for n in (a, c) if isinstance(n, ast.Name)}
        for a, c, node in _pairs(tree):
            side = _constant_side(a, c, consts)
            other = c if side is a else a
            for name in _names(other) & {*COUNTERS, *COUNTS}:
                if name in COUNTERS and (side is None or not isinstance(other, ast.Name) or
                                         not isinstance(node, ast.Compare)):
                    raise CannotCheck(f"{where}: {ast.unparse(node)!r}: the checker can cap "
                                      f"{name} only where it is compared directly with a "
                                      "constant (a parameter, a number, max_running)")
                if side is not None:
                    top = max(_value(side, env) for env in envs)
                    tops[name] = max(tops.get(name, top), top)
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and n.id in COUNTERS and id(n) not in direct:
                raise CannotCheck(f"{where}: {n.id} is used outside a comparison with a "
                                  "constant; the checker cannot cap it exactly")
    return tops


def _check_counts(tops: dict[str, int], max_running: int, max_seqs: int,
                  max_waiting: int) -> None:
    reach = {"num_running": max_running, "num_waiting": max_waiting,
             "num_parked": min(max_running, max_seqs), "num_decoding": min(max_running, max_seqs),
             "num_paused": min(max_running, max_seqs)}
    for name, top in tops.items():
        if name in reach and reach[name] < top + 1:
            raise CannotCheck(f"a rule compares {name} with {top}, but this layout reaches "
                              f"only {reach[name]}: raise --max-seqs / --max-running so it can "
                              f"reach {top + 1}")
