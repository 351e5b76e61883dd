"""Structured output: JSON grammars compiled by llguidance, applied as per-row logit masks.

A request's `response_format` is compiled once, when it is submitted, on the caller's thread
(`GrammarCompiler.compile`): the schema becomes an llguidance grammar, a first matcher is built
and its first mask computed, so every error (a schema llguidance refuses, a feature it does not
implement) is found there, named, and never reaches the engine. The engine gives each constrained
sequence its own copy of that matcher (`Grammar.new_matcher`); the rows of the batch that carry
a matcher get their next-token mask (`token_masks`), which the sampler applies after the other
controls and before the draw (runtime/row_sampling.py), and each sampled token advances the
matcher. EOS is allowed exactly when the grammar accepts. Forced tool calls compile
through `compile_lark` (server/tool_calls.py writes the grammar). Why llguidance: ADR 0012.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions
import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np

# Re-exported: what a grammar is compiled from lives apart, importable without MLX.
from runtime.formats import JSON_STYLE, GrammarError, ResponseFormat
from runtime.limits import MAX_SCHEMA_CHARS

if sys.version_info >= (3, 11):
    from re import _constants as sre_constants
    from re import _parser as sre_parse
else:  # pragma: no cover
    import sre_constants
    import sre_parse

# The most a pattern's repetitions may multiply to along one nesting: llguidance builds such a
# regex lazily and gave up mid-output past ~100,000-200,000 ("too many expressions
# constructed", at the string's opening quote): `a{200000}` failed, `a{100000}` did not.
MAX_PATTERN_REPEATS = 100_000
_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", sre_constants.MAX_REPEAT))

__all__ = ["JSON_STYLE", "Grammar", "GrammarCompiler", "GrammarError", "GrammarMatcher",
           "MatcherError", "ResponseFormat", "apply_masks", "make_grammar_compiler", "token_masks",
           "unpack_bitmask"]


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (a response format, or tool calls): a matcher at the start of the
    output, never advanced; `source` says what it was compiled from."""

    source: str
    compiler: GrammarCompiler
    _template: Any  # llguidance.LLMatcher

    def new_matcher(self) -> GrammarMatcher:
        """A matcher of its own for one sequence, at the start of the output (a copy: ~20 us)."""
        return GrammarMatcher(self._template.deep_copy(), self)


class GrammarMatcher:
    """Where one sequence's output is in its grammar; advanced by each sampled token."""

    def __init__(self, matcher: Any, grammar: Grammar) -> None:
        self._matcher = matcher
        self.grammar = grammar  # a sibling choice (n > 1) starts its own matcher from it
        self.compiler = grammar.compiler

    def consume(self, token: int) -> None:
        """Advance by a sampled token; the mask allowed it, so a refusal is the grammar's
        failure (RuntimeError; the matcher is then in an error state)."""
        with _panics_as(RuntimeError):
            consumed = self._matcher.consume_token(token)
        if not consumed:
            raise RuntimeError(f"the grammar refused token {token}: "
                               f"{_readable(self._matcher.get_error())}")

    def rollback(self) -> None:
        """Undo the last `consume`."""
        with _panics_as(RuntimeError):
            rolled_back = self._matcher.rollback(1)
        if not rolled_back:
            raise RuntimeError(f"grammar matcher could not roll back: {self._matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a whole document of the grammar."""
        return bool(self._matcher.is_accepting())

    def check(self) -> None:
        """Raise if the matcher is in an error state (it could not compute a mask)."""
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {_readable(self._matcher.get_error())}")

    @property
    def raw(self) -> Any:
        return self._matcher


class GrammarCompiler:
    """Compiles response formats for one model's tokenizer (built once: ~0.05 s for the built-in
    vocabulary, longer for a large one); thread-safe, so requests compile off the engine thread.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance.hf

        # n_vocab is the logits' width: the mask must cover every column the model emits.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)

    def compile(self, response_format: ResponseFormat) -> Grammar:
        """A Grammar, or GrammarError naming the field and what llguidance refused in it."""
        param = "response_format.json_schema.schema"
        if response_format.kind == "json_object":
            schema: dict[str, Any] = {"type": "object"}
        else:
            assert response_format.schema is not None
            schema = response_format.schema
        with _schema_refusals(schema, param):
            text = _schema_grammar(schema, param)
            return self._build(text, param, response_format.name or response_format.kind)

    def check_schema(self, schema: dict[str, Any], param: str) -> None:
        """Raise GrammarError naming `param` unless llguidance can enforce `schema`."""
        with _schema_refusals(schema, param):
            error = llguidance.LLMatcher.validate_grammar(_schema_grammar(schema, param),
                                                          self.tokenizer)
            if error:
                raise GrammarError(f"`{param}` cannot be enforced: {error}", param)

    def compile_lark(self, lark: str, param: str, source: str) -> Grammar:
        """A Grammar from a Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON
        schema), or GrammarError naming `param`."""
        with _panics_as(_refusal(param)):
            return self._build(llguidance.LLMatcher.grammar_from_lark(lark), param, source)

    def _build(self, text: str, param: str, source: str) -> Grammar:
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(f"`{param}` cannot be enforced: {error}", param)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        # The first mask builds the lexer: a grammar too large for the engine's limits fails here.
        llg_numpy.fill_next_token_bitmask(matcher, self.allocate(1))
        if matcher.is_error():
            raise GrammarError(f"`{param}` cannot be enforced: "
                               f"{_readable(matcher.get_error())}", param)
        return Grammar(source, self, matcher)

    def allocate(self, rows: int) -> np.ndarray:
        """A bitmask of `rows` rows that allows every token (int32 words, bit i of word w is
        token 32w + i)."""
        return llg_numpy.allocate_token_bitmask(rows, self.vocab_size)


@contextlib.contextmanager
def _panics_as(error: Callable[[str], Exception]) -> Iterator[None]:
    # llguidance is Rust: a panic in it reaches Python as pyo3's PanicException, a
    # BaseException that `except Exception` lets through (a schema whose error message it cut
    # inside a character dropped the connection; on the engine thread it would end the engine).
    try:
        yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise error(f"the grammar engine failed: {exc}") from None


def _refusal(param: str) -> Callable[[str], GrammarError]:
    return lambda message: GrammarError(f"`{param}` cannot be enforced: {message}", param)


@contextlib.contextmanager
def _schema_refusals(schema: dict[str, Any], param: str) -> Iterator[None]:
    # Compiling `schema`: a panic is a refusal, and a refusal is explained (`_explained`).
    try:
        with _panics_as(_refusal(param)):
            yield
    except GrammarError as exc:
        raise _explained(schema, exc) from None


def _readable(error: str) -> str:
    # llguidance's error less the parser state and grammar it appends (hundreds of lines, the
    # client's whole schema among them).
    return error.split("<state>", 1)[0].strip()


def _nodes(node: Any) -> Iterator[dict[str, Any]]:
    # Every object in a schema's tree but those inside values (enum, const, default,
    # examples), where a key such as "multipleOf" or "$ref" is data, not a keyword.
    if isinstance(node, dict):
        yield node
        for key, child in node.items():
            if key not in ("enum", "const", "default", "examples"):
                yield from _nodes(child)
    elif isinstance(node, list):
        for child in node:
            yield from _nodes(child)


def _explained(schema: dict[str, Any], refusal: GrammarError) -> GrammarError:
    # A refused schema that breaks its draft's meta-schema is told by that (the keyword's path
    # and what it must be), clearer than llguidance's message, or its panic's. The meta-schema
    # only explains: llguidance enforces schemas it does not strictly allow (draft-07 tuple
    # `items` without `$schema`, OpenAPI's boolean `exclusiveMinimum`), and still does.
    problem = _meta_problem(schema)
    if problem is None:
        return refusal
    where, message = problem
    return GrammarError(f"`{refusal.param}{where}` is not valid JSON Schema: {message}",
                        refusal.param)


def _meta_problem(schema: dict[str, Any]) -> tuple[str, str] | None:
    # The schema's most relevant error against its draft's meta-schema (its `$schema`, else
    # 2020-12; formats such as a pattern's regex left to llguidance): (path, message).
    declared = schema.get("$schema")
    kind = jsonschema.Draft202012Validator
    try:
        if isinstance(declared, str):
            kind = jsonschema.validators.validator_for(schema, default=kind)
        error = jsonschema.exceptions.best_match(kind(kind.META_SCHEMA).iter_errors(schema))
    except Exception:  # noqa: BLE001 - no explanation, llguidance's message stands
        return None
    if error is None:
        return None
    path = list(error.absolute_path)
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    if path and path[-1] == "type" and error.validator == "anyOf":
        return where, f"{error.instance!r} is not a type: one of {', '.join(_TYPES)}, or a " \
            "list of them"
    return where, error.message if len(error.message) <= 200 else error.message[:197] + "..."


def _check_multiple_of(schema: dict[str, Any], param: str) -> None:
    # JSON Schema asks `multipleOf` > 0; llguidance refuses 0 but took a negative one as its
    # absolute value.
    for node in _nodes(schema):
        value = node.get("multipleOf")
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise GrammarError(f"`{param}`: multipleOf must be greater than 0, got {value}",
                               param)


def _check_patterns(schema: dict[str, Any], param: str) -> None:
    for node in _nodes(schema):
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += [k for k in node["patternProperties"] if isinstance(k, str)]
        for pattern in patterns:
            try:
                count = _most_repeats(sre_parse.parse(pattern))
            except Exception:  # noqa: BLE001 - a syntax Python lacks: llguidance judges it
                continue
            if count > MAX_PATTERN_REPEATS:
                shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
                raise GrammarError(
                    f"`{param}`: pattern {shown!r} repeats up to {count:,} times (its "
                    f"repetition counts multiplied); at most {MAX_PATTERN_REPEATS:,} can be "
                    "enforced", param)


def _most_repeats(node: Any) -> int:
    # The largest product of repetition counts along one nesting of a parsed pattern ({n,}
    # and * count their least).
    if isinstance(node, tuple) and len(node) == 2 and node[0] in _REPEATS:
        least, most, sub = node[1]
        return max(least if most == sre_constants.MAXREPEAT else most, 1) * _most_repeats(sub)
    if isinstance(node, tuple | list | sre_parse.SubPattern):
        return max((_most_repeats(child) for child in node), default=1)
    return 1


def _check_finite(schema: dict[str, Any], param: str) -> None:
    # A schema whose every value must hold another value of itself (a required property, or
    # minItems, through a $ref back to it) admits no finite value: llguidance compiles it and
    # fails mid-output ("Too many items"). Least fixpoint over the $ref targets: a target has a
    # finite value once one is found for it with what is known of the others.
    refs = sorted({n["$ref"] for n in _nodes(schema) if isinstance(n.get("$ref"), str)})
    finite = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref in refs:
            target = _resolve(schema, ref)
            if not finite[ref] and (target is None or _finite(target, finite)):
                finite[ref] = changed = True
    if _finite(schema, finite):
        return
    if not _finite(schema, dict.fromkeys(refs, True)):  # no $ref needed to see it
        raise GrammarError(f"`{param}` admits no value: a required property that its object "
                           "does not allow (not in `properties` with `additionalProperties: "
                           "false`, or a `false` schema), or `minItems` with `items: false`",
                           param)
    raise GrammarError(f"`{param}` admits no finite value: a required property or minItems "
                       "leads back through a $ref to where it started, with no way out", param)


def _resolve(root: dict[str, Any], ref: str) -> Any:
    # A local JSON pointer ("#", "#/$defs/a"); None for one this check cannot follow.
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _finite(node: Any, finite: dict[str, bool]) -> bool:
    # Whether `node` admits a finite value, $refs judged by `finite`.
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    if isinstance(node.get("$ref"), str) and not finite.get(node["$ref"], True):
        return False
    if not all(_finite(s, finite) for s in _list(node, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        if _list(node, key) and not any(_finite(s, finite) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else \
        ["object"] if "required" in node else ["array"] if node.get("minItems") else [None]
    return any(_finite_as(kind, node, finite) for kind in kinds)


def _finite_as(kind: Any, node: dict[str, Any], finite: dict[str, bool]) -> bool:
    if kind == "object":
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        other = node.get("additionalProperties", True)
        return all(_finite(properties.get(name, other), finite)
                   for name in _list(node, "required") if isinstance(name, str))
    if kind == "array":
        prefix, items = _list(node, "prefixItems"), node.get("items", True)
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        return all(_finite(prefix[i] if i < len(prefix) else items, finite)
                   for i in range(min(least, len(prefix) + 1)))
    return True


def _list(node: dict[str, Any], key: str) -> list[Any]:
    # A keyword that should hold a list (a wrong type is llguidance's, or the meta-schema's, to
    # refuse: these checks judge what they can read).
    value = node.get(key)
    return value if isinstance(value, list) else []


def _schema_grammar(schema: dict[str, Any], param: str) -> str:
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"`{param}` is longer than {MAX_SCHEMA_CHARS} characters as JSON",
                           param)
    _check_multiple_of(schema, param)
    _check_patterns(schema, param)
    _check_finite(schema, param)
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE))
    except ValueError as exc:
        raise GrammarError(f"`{param}` is not a usable JSON schema: {exc}", param) from None


def make_grammar_compiler(bundle: Any) -> GrammarCompiler:
    """The compiler for a loaded ModelBundle (its tokenizer must be a Hugging Face fast one)."""
    args = getattr(bundle.model, "args", None)
    vocab_size = getattr(args, "vocab_size", None) or len(bundle.tokenizer.vocab)
    hf = getattr(bundle.tokenizer, "_tokenizer", bundle.tokenizer)
    return GrammarCompiler(hf, int(vocab_size), sorted(bundle.eos_token_ids))


def apply_masks(logits: mx.array, matchers: Sequence[GrammarMatcher | None]) -> mx.array:
    """`logits` (rows, vocab) with every token row i's matcher refuses at -inf; rows without a
    matcher unchanged."""
    allowed = token_masks(logits, matchers)
    return logits if allowed is None else mx.where(allowed, logits, -mx.inf)


def token_masks(logits: mx.array, matchers: Sequence[GrammarMatcher | None]) -> mx.array | None:
    """A bool array like `logits` (rows, vocab): row i's tokens its matcher allows (every token
    in a row without one); None when no row has a matcher. The masks are computed now, from each
    matcher's current state, while MLX computes `logits`."""
    rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    # The masks need only tokens already sampled: MLX runs the forward while llguidance works.
    mx.async_eval(logits)
    bitmask = rows[0][1].compiler.allocate(len(matchers))
    # One row after another on this thread: on 2 shared cores llguidance's thread pool was
    # slower at batch 4 and 16 (ADR 0012).
    for i, m in rows:
        try:
            with _panics_as(RuntimeError):
                llg_numpy.fill_next_token_bitmask(m.raw, bitmask, i)
            m.check()
        except (RuntimeError, ValueError) as exc:
            raise MatcherError(i, exc) from exc
    return unpack_bitmask(bitmask, logits.shape[-1])


class MatcherError(RuntimeError):
    """Row `row`'s matcher could not compute its mask (`token_masks`): llguidance's parser gave
    up on its grammar (e.g. "Too many items")."""

    def __init__(self, row: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.row = row


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> mx.array:
    """A bool array (rows, vocab) from int32 bitmask words."""
    words = mx.array(bitmask.view(np.uint32))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(mx.bool_)
