"""Load and validate the YAML specs in specs/ into frozen dataclasses.

Every problem is a `SpecError` naming the file, the line, the field and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from statemachine.expr import Expr, ExprError, Kind, Var, compile_expr, show_bound
from statemachine.yamlsrc import Path_, Source, SpecError, load_source

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
POLICIES_DIR = SPECS_DIR / "policies"
DEFAULT_POLICY = "token_budget_lane"

Action = Literal["idle", "decode", "prefill", "mixed"]
ACTIONS: tuple[Action, ...] = ("idle", "decode", "prefill", "mixed")
PICKS = ("round_robin", "oldest_first", "fewest_left")
# What the scheduler does when the KV budget cannot hold this tick's decode tokens or an arrival:
# queue: admission reserves prompt + max_tokens, so running sequences never run out; arrivals
#   wait. recompute: KV is counted as used; the youngest running sequence drops its KV and is
#   re-prefilled later. pause: the youngest decoding sequences keep their KV and pause until
#   there is room (the youngest paused one is dropped when nothing else can run).
KV_FULL = ("queue", "recompute", "pause")
# Claims a policy must make (`unbounded` is an honest answer), then the two it may make: when
# omitted, they are the bounds that follow from the others (docs/specs.md). A claim may name
# the claims before it in this order.
BASE_CLAIMS = ("wait_ticks", "overtakes", "decode_wait_ticks", "preemptions", "queue_ticks")
DERIVED_CLAIMS = ("first_grant_ticks", "ttft_ticks")
CLAIMS = (*BASE_CLAIMS, *DERIVED_CLAIMS)

# Names a rule condition (and the grants / chunk_tokens sizes) may use: TickState fields, each
# with the range of its values (a division by a name whose range holds 0 is refused at load).
STATE_FIELDS: dict[str, Var] = {
    "max_running": Var(low=1), "num_running": Var(low=0), "num_waiting": Var(low=0),
    "num_parked": Var(low=0), "num_decoding": Var(low=0), "num_paused": Var(low=0),
    "decode_streak": Var(low=0), "decode_wait_ticks": Var(low=0), "max_wait_ticks": Var(low=0),
    "chunk_size": Var(low=1), "budget_tokens": Var(low=0),
}
# Names a claim may use besides the parameters: the configuration being checked (max_tokens is
# unbounded when requests may generate forever: a claim that uses it is then unbounded too).
CLAIM_FIELDS: dict[str, Var] = {"max_running": Var(low=1), "max_seqs": Var(low=1),
                                "chunks": Var(low=1), "max_chunks": Var(low=1),
                                "max_prompt_tokens": Var(low=1), "max_tokens": Var(low=1)}

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ParameterSpec:
    """A tunable number of a policy, settable by CLI flag or environment variable."""

    name: str
    default: int | float
    minimum: int | float
    maximum: int | float
    flag: str
    env: str
    doc: str

    @property
    def integral(self) -> bool:
        """Whether only whole numbers are allowed."""
        return all(isinstance(v, int) for v in (self.default, self.minimum, self.maximum))

    def validate(self, value: int | float, origin: str) -> int | float:
        """Return `value` converted to the parameter's type, or raise ValueError naming it. A
        parameter is an integer when its default and both ends of its range are."""
        if self.integral and not float(value).is_integer():
            raise ValueError(f"{origin}: {self.name} must be an integer, got {value}")
        value = int(value) if self.integral else float(value)
        if not self.minimum <= value <= self.maximum:
            raise ValueError(f"{origin}: {self.name} must be in [{self.minimum}, "
                             f"{self.maximum}], got {value}")
        return value


@dataclass(frozen=True)
class Rule:
    """`when` the condition holds (first match wins), the tick takes `action`."""

    name: str
    when: Expr
    action: Action
    line: int | None


@dataclass(frozen=True)
class LaneSpec:
    """A policy's prefill lane: its slices' tokens, and the decode rows' least period over the
    tick's target (both over the policy's parameters)."""

    chunk_tokens: Expr
    pace: Expr


@dataclass(frozen=True)
class PolicySpec:
    """A tick policy as declared in YAML, with its expressions compiled."""

    name: str
    doc: str
    file: str
    parameters: tuple[ParameterSpec, ...]
    pick: str
    grants: Expr
    chunk_tokens: Expr
    rules: tuple[Rule, ...]
    claims: dict[str, Expr | None]  # None: the policy honestly claims no bound
    kv_full: str = "recompute"
    # Milliseconds a tick may take (over parameters and `decode_step_ms`, the p95 of a decode
    # step as measured on this machine now); the engine turns it into `budget_tokens` for each
    # tick. None: no latency target.
    tick_budget_ms: Expr | None = None
    # A prefill lane (ADR 0016): in a tick with decode rows and a grant, the slices run on a
    # second thread, `chunk_tokens` of them, while the rows step at most once every `pace`
    # times the tick's target, one or more times; None: a tick is one forward.
    lane: LaneSpec | None = None

    def parameter(self, name: str) -> ParameterSpec:
        """The parameter called `name`; KeyError if the policy has none."""
        for p in self.parameters:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def defaults(self) -> dict[str, int | float]:
        return {p.name: p.default for p in self.parameters}


def resolve_policy_path(name_or_path: str | Path) -> Path:
    """A shipped policy name (`deadline`) or a path to a YAML file."""
    text = str(name_or_path)
    if text == "default":
        text = DEFAULT_POLICY
    if _NAME.match(text) and (POLICIES_DIR / f"{text}.yaml").exists():
        return POLICIES_DIR / f"{text}.yaml"
    path = Path(text)
    if path.exists():
        return path
    shipped = ", ".join(shipped_policy_names())
    raise SpecError(text, None, "<policy>", f"no such policy file or shipped policy; "
                    f"shipped: {shipped}")


def shipped_policy_names() -> list[str]:
    """Names of the policies in specs/policies/."""
    return sorted(p.stem for p in POLICIES_DIR.glob("*.yaml"))


def load_policy(name_or_path: str | Path) -> PolicySpec:
    """Load, validate and compile one policy spec."""
    src = load_source(resolve_policy_path(name_or_path))
    doc = src.data
    if not isinstance(doc, dict):
        raise src.error((), "a policy spec is a mapping with name, doc, pick, rules, claims")
    _known_keys(src, (), doc, {"name", "doc", "parameters", "pick", "grants", "chunk_tokens",
                               "rules", "claims", "tick_budget_ms", "kv_full", "lane"})
    name = _required(src, ("name",), doc, str)
    if not _NAME.match(name):
        raise src.error(("name",), "must be lower_snake_case letters, digits and _")
    params = _parameters(src, doc.get("parameters") or {})
    param_vars = {p.name: Var("num", p.minimum, p.maximum) for p in params}
    names = {**STATE_FIELDS, **param_vars}
    pick = doc.get("pick", "round_robin")
    if pick not in PICKS:
        raise src.error(("pick",), f"unknown pick rule {pick!r}; allowed: {', '.join(PICKS)}")
    kv_full = doc.get("kv_full", "recompute")
    if kv_full not in KV_FULL:
        raise src.error(("kv_full",), f"unknown {kv_full!r}; allowed: {', '.join(KV_FULL)}")
    return PolicySpec(
        name=name,
        doc=_required(src, ("doc",), doc, str).strip(),
        file=src.file,
        parameters=params,
        pick=pick,
        grants=_at_least(src, ("grants",), _expr(src, ("grants",), doc.get("grants", 1), names,
                                                 "num"), 1, "a tick grants at least one prompt"),
        chunk_tokens=_expr(src, ("chunk_tokens",), doc.get("chunk_tokens", "chunk_size"),
                           names, "num"),
        rules=_rules(src, doc.get("rules"), names),
        claims=_claims(src, doc.get("claims"), {**CLAIM_FIELDS, **param_vars}),
        kv_full=kv_full,
        tick_budget_ms=None if "tick_budget_ms" not in doc else _expr(
            src, ("tick_budget_ms",), doc["tick_budget_ms"],
            {"decode_step_ms": Var(low=0), **param_vars}, "num"),
        lane=None if "lane" not in doc else _lane(src, doc, param_vars),
    )


def _lane(src: Source, doc: dict[str, Any], param_vars: dict[str, Var]) -> LaneSpec:
    raw = doc["lane"]
    if not isinstance(raw, dict):
        raise src.error(("lane",), "must be a mapping with chunk_tokens and pace")
    _known_keys(src, ("lane",), raw, {"chunk_tokens", "pace"})
    if "tick_budget_ms" not in doc:
        raise src.error(("lane",), "needs tick_budget_ms: the lane's pace is a share of the "
                        "tick's target")
    for key in ("chunk_tokens", "pace"):
        if key not in raw:
            raise src.error(("lane", key), "is required")
    chunk = _at_least(src, ("lane", "chunk_tokens"), _expr(
        src, ("lane", "chunk_tokens"), raw["chunk_tokens"], param_vars, "num"), 1,
        "a lane's slice holds at least one token")
    pace = _expr(src, ("lane", "pace"), raw["pace"], param_vars, "num")
    if pace.low <= 0 or pace.high > 1:
        raise src.error(("lane", "pace"), f"must lie in (0, 1] (a share of the tick's target); "
                        f"{pace.source!r} ranges over [{show_bound(pace.low)}, "
                        f"{show_bound(pace.high)}]")
    return LaneSpec(chunk, pace)


def _at_least(src: Source, path: Path_, expr: Expr, least: int, why: str) -> Expr:
    # Refused where no value of its names (the parameters' ranges, the state's) brings it to
    # `least`, by the expression's interval: a negative bound was reported VIOLATED, -2 grants
    # ran as 1. One that is below only somewhere is checked where it is evaluated.
    if expr.high < least:
        raise src.error(path, f"must be at least {least} ({why}); {expr.source!r} ranges over "
                        f"[{show_bound(expr.low)}, {show_bound(expr.high)}]")
    return expr


def _required(src: Source, path: Path_, doc: dict[str, Any], kind: type) -> Any:
    key = str(path[-1])
    if key not in doc:
        raise src.error(path, "is required")
    if not isinstance(doc[key], kind):
        raise src.error(path, f"must be a {kind.__name__}, got {type(doc[key]).__name__}")
    return doc[key]


def _known_keys(src: Source, path: Path_, doc: dict[str, Any], allowed: set[str]) -> None:
    for key in doc:
        if key not in allowed:
            raise src.error((*path, key), f"unknown field; allowed: {', '.join(sorted(allowed))}")


def _expr(src: Source, path: Path_, text: Any, names: dict[str, Var], want: Kind) -> Expr:
    try:
        return compile_expr(text, names, want)
    except ExprError as exc:
        raise src.error(path, str(exc)) from exc


def _parameters(src: Source, raw: Any) -> tuple[ParameterSpec, ...]:
    if not isinstance(raw, dict):
        raise src.error(("parameters",), "must be a mapping of name -> {default, range, ...}")
    out = []
    for name, body in raw.items():
        path: Path_ = ("parameters", name)
        if not _NAME.match(name) or name in STATE_FIELDS or name in CLAIM_FIELDS:
            raise src.error(path, "parameter names are lower_snake_case and must not shadow a "
                            "state field")
        if not isinstance(body, dict):
            raise src.error(path, "must be a mapping with default, range, flag, env, doc")
        _known_keys(src, path, body, {"default", "range", "flag", "env", "doc"})
        default = body.get("default")
        if isinstance(default, bool) or not isinstance(default, int | float):
            raise src.error((*path, "default"), "must be a number")
        rng = body.get("range")
        if not (isinstance(rng, list) and len(rng) == 2
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in rng)
                and rng[0] <= rng[1]):
            raise src.error((*path, "range"), "must be [min, max] with min <= max")
        if not rng[0] <= default <= rng[1]:
            raise src.error((*path, "default"), f"{default} is outside range {rng}")
        flag = body.get("flag", "--" + name.replace("_", "-"))
        env = body.get("env", "FAIRTICK_" + name.upper())
        if not (isinstance(flag, str) and re.match(r"^--[a-z][a-z0-9-]*$", flag)):
            raise src.error((*path, "flag"), "must look like --some-name")
        if not (isinstance(env, str) and re.match(r"^FAIRTICK_[A-Z0-9_]+$", env)):
            raise src.error((*path, "env"), "must look like FAIRTICK_SOME_NAME")
        out.append(ParameterSpec(name, default, rng[0], rng[1], flag, env,
                                 str(body.get("doc", "")).strip()))
    return tuple(out)


def _rules(src: Source, raw: Any, names: dict[str, Var]) -> tuple[Rule, ...]:
    if not isinstance(raw, list) or not raw:
        raise src.error(("rules",), "must be a non-empty list of {name, when, action}")
    rules, seen = [], set()
    for i, body in enumerate(raw):
        path: Path_ = ("rules", i)
        if not isinstance(body, dict):
            raise src.error(path, "each rule is a mapping with name, when, action")
        _known_keys(src, path, body, {"name", "when", "action", "doc"})
        name = _required(src, (*path, "name"), body, str)
        if name in seen:
            raise src.error((*path, "name"), f"duplicate rule name {name!r}")
        seen.add(name)
        action = body.get("action")
        if action not in ACTIONS:
            raise src.error((*path, "action"), f"must be one of {', '.join(ACTIONS)}")
        when = _expr(src, (*path, "when"), body.get("when", True), names, "bool")
        rules.append(Rule(name, when, action, src.line(path)))
    return tuple(rules)


def _claims(src: Source, raw: Any, names: dict[str, Var]) -> dict[str, Expr | None]:
    if not isinstance(raw, dict):
        raise src.error(("claims",), f"must be a mapping with {', '.join(BASE_CLAIMS)}")
    _known_keys(src, ("claims",), raw, set(CLAIMS))
    out: dict[str, Expr | None] = {}
    scope = dict(names)
    for claim in CLAIMS:
        if claim in raw:
            value = raw[claim]
            out[claim] = None if value == "unbounded" else _at_least(
                src, ("claims", claim), _expr(src, ("claims", claim), value, scope, "num"), 0,
                "a bound counts ticks or preemptions")
        elif claim not in DERIVED_CLAIMS:  # a derived one defaults to the bound that follows
            raise src.error(("claims", claim), "is required (write `unbounded` if there is none)")
        scope[claim] = Var(low=0)  # the claims after it may name it
    return out
