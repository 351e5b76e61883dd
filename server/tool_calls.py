"""Tool calls in the Hermes format: the prompt that offers tools, the grammar that forces a call,
and the parser that reads calls out of the output, whole or streamed.

fairtick reads and writes a tool call as the Qwen2.5/Qwen3 and Hermes chat templates do:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Bonn"}}
    </tool_call>

A model whose chat template takes `tools` and mentions `<tool_call>` gets its tools through the
template; a model whose template takes no tools (the built-in model has none) gets them in a
system message that asks for this format (`tools_system_prompt`); a template that takes tools
but writes another format is not served (`tool_format` says which). `tool_choice` "required"
or a named function is enforced by a grammar (`tool_call_lark`): the output is one call (several
with `parallel_tool_calls`) whose arguments validate against the function's parameters.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from runtime.formats import JSON_STYLE

if TYPE_CHECKING:  # runtime/grammar.py imports MLX; validation must not
    from runtime.grammar import Grammar, GrammarCompiler

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# A function declared without parameters takes none: its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

ChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class Function:
    """One tool the request offers: `tools[i].function`; `parameters` is a JSON Schema whose
    "type" is "object" (server/tool_request.py makes it one), so a call's arguments are an
    object in the grammar, in the parser and in a client's calls sent back."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`: none, auto, required, or the function named `name`."""

    mode: ChoiceMode
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the output must be calls ("required" or a named function): a grammar
        enforces them (`compile_tool_calls`), and the output is calls only."""
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolCall:
    """A call read from the output, in OpenAI's terms (`arguments` is JSON text)."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_format(chat_template: str | None) -> Literal["template", "fallback"] | None:
    """How a model with this chat template is offered tools: through the template, through the
    fallback system message (no template, or one that takes no tools), or not at all (None: the
    template takes tools but writes calls in a format this module does not read)."""
    if not chat_template or "tools" not in chat_template:
        return "fallback"
    return "template" if OPEN in chat_template else None


def tools_system_prompt(functions: list[Function]) -> str:
    """The system message that offers tools to a model whose template cannot."""
    specs = [{"type": "function", "function": {
        "name": f.name, **({"description": f.description} if f.description else {}),
        "parameters": f.parameters}} for f in functions]
    return ("You may call one or more functions to assist with the user query. The functions "
            "are, as JSON schemas:\n" + "\n".join(json.dumps(s) for s in specs) + "\n"
            "To call a function, answer with one block per call:\n"
            f"{OPEN}\n" + '{"name": <function name>, "arguments": <arguments as a JSON object>}'
            f"\n{CLOSE}")


def render_call(name: str, arguments: str) -> str:
    """One call as the format writes it (an assistant turn's earlier calls, in the fallback)."""
    return f"{OPEN}\n{{\"name\": {json.dumps(name)}, \"arguments\": {arguments}}}\n{CLOSE}"


def tool_call_lark(functions: list[Function], choice: ToolChoice, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of an output that is only tool calls: of the
    named function, or of any of `functions` for "required". Each function's call is a rule of
    its own whose arguments are a `%json` of its parameters alone, so the schema's `$ref`s
    ("#", "#/$defs/...", as pydantic writes them) resolve against it (inside a schema wrapping
    every call, they resolved against the wrapper: a 400, or a recursive "#" that asked for a
    whole call). The text around the arguments is what JSON_STYLE writes."""
    chosen = [f for f in functions if choice.mode != "function" or f.name == choice.name]
    assert chosen, "the named function must be among the tools (checked when reading)"
    key, item = JSON_STYLE["key_separator"], JSON_STYLE["item_separator"]
    rules = []
    for k, f in enumerate(chosen):
        head = f'{OPEN}\n{{"name"{key}{json.dumps(f.name)}{item}"arguments"{key}'
        arguments = {**f.parameters, "x-guidance": JSON_STYLE}
        rules.append(f"call_{k}: {json.dumps(head)} %json {json.dumps(arguments)} "
                     f"{json.dumps('}' + chr(10) + CLOSE)}")
    calls = 'call ("\\n" call)*' if parallel else "call"
    alternatives = " | ".join(f"call_{k}" for k in range(len(chosen)))
    return f"start: {calls}\ncall: {alternatives}\n" + "\n".join(rules) + "\n"


def compile_tool_calls(compiler: GrammarCompiler, functions: list[Function], choice: ToolChoice,
                       parallel: bool) -> Grammar | None:
    """The grammar that `choice` enforces (None for "auto" and "none"); a GrammarError names
    `tools[i].function.parameters` when a function's parameters cannot be enforced."""
    for i, function in enumerate(functions):
        compiler.check_schema(function.parameters, f"tools[{i}].function.parameters")
    if not choice.forced:
        return None
    return compiler.compile_lark(tool_call_lark(functions, choice, parallel), "tools",
                                 "tool_calls")


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of a whole output: the text without its call blocks, stripped
    (None when calls leave nothing). A block that is not a call of one of `names` (bad JSON,
    another shape, an unknown function) stays in the content as written."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        call = _read_call(match.group(1), names)
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    content = _BLOCK.sub(take, text).strip()
    return (content or None) if calls else content, calls


def parse_forced_calls(text: str, names: set[str], choice: ToolChoice) -> list[ToolCall]:
    """The calls of an output under a forced choice ("required" or a named function), whose
    grammar lets it write calls only: each whole block's, then, where the output was cut inside
    a block (by max_tokens or a stop string), the call that block was writing (`cut_call`).
    Nothing of it is content: a cut block's markup is not the model's text."""
    _, calls = parse_tool_calls(text, names)
    end = text.rfind(CLOSE)
    cut = cut_call(text[end + len(CLOSE):] if end >= 0 else text, names, choice)
    return calls if cut is None else [*calls, cut]


def cut_call(tail: str, names: set[str], choice: ToolChoice) -> ToolCall | None:
    """The call that `tail`, the end of a forced choice's output after its last whole block, was
    writing when the output was cut: its function (the choice's, or the one the block names
    once that name is written whole) and its arguments as far as they were written (not JSON,
    unless the cut fell after them: then the whole arguments, as `_read_call` writes them).
    None when `tail` holds no block, or no function is known yet."""
    tail = tail.lstrip()
    if not tail or not (tail.startswith(OPEN) or OPEN.startswith(tail)):
        return None
    body = tail[len(OPEN):]
    named = _CUT_NAME.match(body)
    name = choice.name if choice.mode == "function" else None
    if named is not None:
        try:
            written = json.loads(named.group(1))
        except ValueError:
            written = None
        name = name or (written if written in names else None)
    if name is None:
        return None
    if named is None or not named.group(2):
        return ToolCall(new_call_id(), name, "")
    arguments = body[named.end():]
    try:
        value, _ = json.JSONDecoder(parse_constant=_no_constant,
                                    parse_float=_Float).raw_decode(arguments)
    except ValueError:
        return ToolCall(new_call_id(), name, arguments)  # cut inside them
    return ToolCall(new_call_id(), name, _dumps_numbers_as_written(value))


# The head of a call block as far as its name (group 1) and, once written, the arguments' key
# (group 2); the arguments follow the match.
_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*'
                       r'(,\s*"arguments"\s*:\s*)?', re.DOTALL)


def loads_as_written(text: str) -> Any:
    """`text` as JSON with each number that has a fraction or exponent kept as written (`_Float`):
    a number past the float range is valid JSON (a tool call's arguments may hold one, as the
    model wrote it); NaN and Infinity, which are not, are a ValueError."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_Float)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read_call(body: str, names: set[str]) -> ToolCall | None:
    # Arguments that are not an object are no call (OpenAI's contract, and what a client may
    # send back): under "auto" such a block stays the model's text; forced choices cannot write it.
    # A number past the float range is valid JSON, and a grammar (any schema's unbounded
    # "number") lets a model write one: it is kept as written, where json would make it
    # Infinity (not JSON) and the forced call was lost to the content.
    try:
        value = loads_as_written(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and value.get("name") in names
            and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(new_call_id(), value["name"], _dumps_numbers_as_written(value["arguments"]))


@dataclass(frozen=True)
class _Float:
    """A JSON number with a fraction or exponent, as written."""

    text: str


def _dumps_numbers_as_written(value: Any) -> str:
    # json.dumps, each float as its literal: Python's shortest repr (json.dumps's own) when
    # the float range holds it, else as written.
    literals: list[str] = []
    mark = uuid.uuid4().hex  # no string of the arguments holds it

    def literal(number: Any) -> str:
        if not isinstance(number, _Float):
            raise TypeError(f"{type(number).__name__} is not JSON")
        as_float = float(number.text)
        literals.append(repr(as_float) if math.isfinite(as_float) else number.text)
        return f"{mark}{len(literals) - 1}{mark}"

    text = json.dumps(value, default=literal)
    return re.sub(f'"{mark}(\\d+){mark}"', lambda m: literals[int(m.group(1))], text)


class ToolCallStream:
    """Splits streamed text into content and calls as `parse_tool_calls` does the whole text.

    `feed` returns what is decided so far (content strings and ToolCalls, in order); it holds
    back text that may begin a block, a block until it closes, and whitespace until content
    follows it (the content is stripped, as the whole parse strips it)."""

    def __init__(self, names: set[str], forced: ToolChoice | None = None) -> None:
        self.names = names
        self.forced = forced  # a forced choice: its output is calls only (`parse_forced_calls`)
        self._pending = ""  # undecided text
        self._space = ""  # whitespace held until content follows it
        self._started = False  # any content emitted yet

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        out: list[str | ToolCall] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_open(self._pending)
                self._content(self._pending[: len(self._pending) - keep], out)
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            end = self._pending.find(CLOSE, start)
            if end < 0:
                self._content(self._pending[:start], out)
                self._pending = self._pending[start:]
                return out
            self._content(self._pending[:start], out)
            block = self._pending[start: end + len(CLOSE)]
            self._pending = self._pending[end + len(CLOSE):]
            call = _read_call(block[len(OPEN): -len(CLOSE)], self.names)
            if call is None:
                self._content(block, out)
            else:
                out.append(call)

    def finish(self) -> list[str | ToolCall]:
        """What is left: an unclosed block or a partial tag is content; under a forced choice,
        the call it was writing (`cut_call`), if any."""
        out: list[str | ToolCall] = []
        if self.forced is not None:
            cut = cut_call(self._pending, self.names, self.forced)
            if cut is not None:
                out.append(cut)
        else:
            self._content(self._pending, out)
        self._pending = ""
        return out

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if not text:
            return
        if not text.strip():
            self._space += text
            return
        lead = text[: len(text) - len(text.lstrip())]
        body = text[len(lead):]
        trail = body[len(body.rstrip()):]
        body = body[: len(body) - len(trail)]
        out.append((self._space + lead if self._started else "") + body)
        self._started, self._space = True, trail


def _partial_open(text: str) -> int:
    # The length of the longest end of `text` that is a proper beginning of OPEN.
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0
