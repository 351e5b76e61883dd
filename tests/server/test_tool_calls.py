"""server/tool_calls.py: the Hermes tool-call format offered, enforced and read back.

The grammar tests run the real built-in model through the real engine: its free output is
noise, so every call that parses and validates comes from the grammar."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.api import GenerationRequest
from runtime.engine import Engine, EngineConfig
from runtime.grammar import GrammarError, make_grammar_compiler
from runtime.sampling import SamplingParams
from server.tool_calls import (
    CLOSE,
    OPEN,
    Function,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    compile_tool_calls,
    parse_forced_calls,
    parse_tool_calls,
    render_call,
    tool_format,
    tools_system_prompt,
)
from tests.runtime.engine_harness import Collector

WEATHER = Function("get_weather", "The weather in a city", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False})
TIME = Function("get_time", None, {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False})
PING = Function("ping")
FUNCTIONS = [WEATHER, TIME, PING]
NAMES = {f.name for f in FUNCTIONS}
BY_NAME = {f.name: f for f in FUNCTIONS}


def calls_of(parts: list[str | ToolCall]) -> list[tuple[str, str]]:
    return [(p.name, p.arguments) for p in parts if isinstance(p, ToolCall)]


def test_calls_are_read_with_ids_and_json_arguments():
    weather = render_call("get_weather", json.dumps({"city": "Bonn", "unit": "C"}))
    text = f"Let me check.\n{weather}\n{render_call('ping', '{}')}\n"
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Bonn", "unit": "C"}), ("ping", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("block", [
    f"{OPEN}\n{{not json}}\n{CLOSE}",
    f'{OPEN}\n{{"name": "unknown", "arguments": {{}}}}\n{CLOSE}',
    f'{OPEN}\n{{"name": "ping", "arguments": "{{}}"}}\n{CLOSE}',
    f'{OPEN}\n{{"name": "ping", "arguments": null}}\n{CLOSE}',
    f'{OPEN}\n{{"name": "ping", "arguments": -0e4358598490}}\n{CLOSE}',
    f'{OPEN}\n{{"name": "ping"}}\n{CLOSE}',
    f'{OPEN}\n["ping"]\n{CLOSE}',
    # Not JSON, though Python's json reads it.
    f'{OPEN}\n{{"name": "ping", "arguments": {{"a": NaN}}}}\n{CLOSE}',
])
def test_a_block_that_is_not_a_call_stays_content(block):
    # Arguments are a JSON object (OpenAI's contract, and what a client may send back): under
    # "auto" a block with other arguments is the model's text, not a call.
    content, calls = parse_tool_calls(f"a {block} b", NAMES)
    assert calls == [] and content == f"a {block} b"


def test_a_number_past_the_float_range_is_kept_as_written():
    # Valid JSON that a grammar's unbounded "number" lets a model write (a forced call's
    # `{"v": 40e4974848...}`): the call was lost to the content, as finish_reason "stop".
    block = f'{OPEN}\n{{"name": "ping", "arguments": {{"a": 40e497484802164555, "b": [1.50, ' \
        f'-2E-3, "x"]}}}}\n{CLOSE}'
    content, calls = parse_tool_calls(block, NAMES)
    assert content is None and [c.name for c in calls] == ["ping"]
    assert calls[0].arguments == '{"a": 40e497484802164555, "b": [1.5, -0.002, "x"]}'


def test_only_calls_leave_no_content_and_plain_text_is_content():
    assert parse_tool_calls(f"\n{render_call('ping', '{}')}\n", NAMES)[0] is None
    assert parse_tool_calls("  plain words ", NAMES) == ("plain words", [])


_PIECES = st.sampled_from([
    "hello", " ", "\n", "<", "<tool", OPEN, CLOSE, "</", "x y", "tool_call>",
    render_call("ping", "{}"), render_call("get_time", '{"zone": 3}'),
    render_call("nope", "{}"), f"{OPEN}\n{{bad\n{CLOSE}"])


@given(st.lists(_PIECES, max_size=12), st.randoms(use_true_random=False))
def test_streaming_in_any_chunks_reads_what_the_whole_text_reads(pieces, rnd):
    text = "".join(pieces)
    cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, rnd.randint(0, 8))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream, parts = ToolCallStream(NAMES), []
    for chunk in chunks:
        parts += stream.feed(chunk)
    parts += stream.finish()
    content, calls = parse_tool_calls(text, NAMES)
    assert "".join(p for p in parts if isinstance(p, str)) == (content or "")
    assert calls_of(parts) == [(c.name, c.arguments) for c in calls]


def test_a_partial_tag_is_held_back_until_decided():
    stream = ToolCallStream(NAMES)
    assert stream.feed("hi <tool_") == ["hi"]
    assert stream.feed("cal") == []
    assert stream.feed("x> there") == [" <tool_calx> there"]


WEATHER_ARGS = '{"city": "Bonn", "unit": "C"}'
FORCED_OUTPUT = render_call("get_time", '{"zone": 3}') + "\n" + \
    render_call("get_weather", WEATHER_ARGS)
FORCED_CHOICES = [ToolChoice("required"), ToolChoice("function", "get_weather")]


def cut_short(text: str, choice: ToolChoice) -> list[tuple[str, str]]:
    """What the calls of a forced output cut after `text` must be: the whole blocks' calls, then
    the block being written, once its function is known (the choice's, or its name written
    whole), with its arguments as far as written (all of them once whole)."""
    whole, _, tail = text.rpartition(CLOSE)
    calls = calls_of(parse_tool_calls(whole + CLOSE, NAMES)[1]) if whole else []
    if not tail.strip():
        return calls
    head = tail[tail.find(OPEN):] if OPEN in tail else ""
    name = "get_weather" if choice.mode == "function" else None
    if '"name": "get_weather"' in head:
        name = "get_weather"
    if name is None:
        return calls
    key = '"arguments": '
    written = head[head.index(key) + len(key):] if key in head else ""
    return [*calls, (name, WEATHER_ARGS if written.startswith(WEATHER_ARGS) else written)]


@pytest.mark.parametrize("choice", FORCED_CHOICES, ids=lambda c: c.mode)
def test_a_forced_output_cut_anywhere_keeps_the_call_it_was_writing(choice):
    # max_tokens or a stop string may end a forced choice's output inside a block: the client
    # still gets calls only (OpenAI: a call whose arguments stop where the output stopped), not
    # the block's markup as content. In the named choice every cut is a call of that function.
    assert FORCED_OUTPUT.startswith(OPEN + '\n{"name": "get_time"')
    second = FORCED_OUTPUT.index(CLOSE) + len(CLOSE)
    for cut in range(second, len(FORCED_OUTPUT) + 1):
        text = FORCED_OUTPUT[:cut]
        calls = parse_forced_calls(text, NAMES, choice)
        assert [(c.name, c.arguments) for c in calls] == cut_short(text, choice), text
    # From the second block's first character (after the "\n" between blocks) to its end.
    named = [parse_forced_calls(FORCED_OUTPUT[second:cut], NAMES, FORCED_CHOICES[1])
             for cut in range(second + 2, len(FORCED_OUTPUT) + 1)]
    assert all([c.name for c in calls] == ["get_weather"] for calls in named)
    assert named[0][0].arguments == "" and named[-1][0].arguments == WEATHER_ARGS
    assert any(calls[0].arguments == '{"city": "Bo' for calls in named)
    # "required" knows the function once its name is written whole.
    assert parse_forced_calls(OPEN + '\n{"name": "get_wea', NAMES, FORCED_CHOICES[0]) == []
    assert parse_forced_calls("", NAMES, FORCED_CHOICES[1]) == []


@given(st.integers(min_value=0), st.sampled_from(FORCED_CHOICES),
       st.randoms(use_true_random=False))
def test_a_forced_stream_cut_anywhere_reads_what_the_whole_text_reads(at, choice, rnd):
    text = FORCED_OUTPUT[:at % (len(FORCED_OUTPUT) + 1)]
    cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, rnd.randint(0, 8))))
    stream, parts = ToolCallStream(NAMES, choice), []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        parts += stream.feed(text[a:b])
    parts += stream.finish()
    assert not [p for p in parts if isinstance(p, str)], "a forced choice writes no content"
    assert calls_of(parts) == [(c.name, c.arguments)
                               for c in parse_forced_calls(text, NAMES, choice)]


def test_tool_format_follows_the_chat_template():
    assert tool_format(None) == "fallback"
    assert tool_format("{{ messages }}") == "fallback"
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == "template"
    assert tool_format("{% if tools %}[TOOL_CALLS]{% endif %}") is None


def test_the_fallback_prompt_names_every_function_and_the_format():
    prompt = tools_system_prompt(FUNCTIONS)
    for f in FUNCTIONS:
        assert json.dumps(f.parameters) in prompt and f'"name": "{f.name}"' in prompt
    assert OPEN in prompt and CLOSE in prompt


def test_parameters_the_grammar_engine_cannot_enforce_name_the_tool(bundle):
    compiler = make_grammar_compiler(bundle)
    bad = Function("bad", None, {"type": "object", "properties": {"a": {"not": {}}}})
    with pytest.raises(GrammarError) as info:
        compile_tool_calls(compiler, [WEATHER, bad], ToolChoice("auto"), True)
    assert info.value.param == "tools[1].function.parameters"
    assert "not" in str(info.value)
    assert compile_tool_calls(compiler, FUNCTIONS, ToolChoice("auto"), True) is None


@pytest.mark.parametrize(("choice", "parallel"), [
    (ToolChoice("required"), False), (ToolChoice("required"), True),
    (ToolChoice("function", "get_weather"), False), (ToolChoice("function", "get_time"), True),
])
def test_a_forced_choice_makes_the_noise_model_call_a_tool(bundle, choice, parallel):
    engine, got = Engine(EngineConfig(max_running=8), bundle), Collector()
    engine.start()
    ids = [f"r{seed}" for seed in range(4)]
    try:
        grammar = compile_tool_calls(engine.grammars, FUNCTIONS, choice, parallel)
        assert grammar is not None
        for seed, rid in enumerate(ids):
            # After each call the model picks between EOS and another call: with parallel calls
            # greedy noise may never stop, sampled noise stops after a few.
            greedy = seed == 0 and not parallel
            sampling = SamplingParams(max_tokens=1000, temperature=0.0 if greedy else 1.0,
                                      seed=seed)
            prompt = tuple(random.Random(seed).randrange(32, 127) for _ in range(12))
            engine.submit(GenerationRequest(rid, prompt, sampling, grammar=grammar), got.sink)
        got.wait(*ids)
    finally:
        engine.stop()
    for rid in ids:
        assert got.last(rid).finish_reason == "stop"
        content, calls = parse_tool_calls(got.text(rid), NAMES)
        assert content is None and calls and (parallel or len(calls) == 1)
        for call in calls:
            assert choice.mode == "required" or call.name == choice.name
            jsonschema.validate(json.loads(call.arguments), BY_NAME[call.name].parameters)


# What `openai.pydantic_function_tool` writes for a model with a nested model and an enum:
# `$defs` and `$ref`s from the parameters' own root; and a tree whose child is the whole schema.
NESTED = Function("place", None, {
    "type": "object", "additionalProperties": False, "required": ["inner", "colour"],
    "properties": {"inner": {"$ref": "#/$defs/Inner"}, "colour": {"$ref": "#/$defs/Colour"}},
    "$defs": {
        "Inner": {"type": "object", "additionalProperties": False, "required": ["x"],
                  "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "Colour": {"type": "string", "enum": ["red", "green"]}}})
TREE = Function("tree", None, {
    "type": "object", "additionalProperties": False, "required": ["v", "child"],
    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                   "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}})


def test_parameters_refs_resolve_against_their_own_schema_in_forced_calls(bundle):
    # Wrapped in one schema of every call, "#/$defs/Inner" was missing (a 400) and "#" asked for
    # a whole call ({"name": ..., "arguments": ...}) as the tree's child.
    engine, got = Engine(EngineConfig(max_running=8), bundle), Collector()
    engine.start()
    ids = [f"r{seed}" for seed in range(6)]
    try:
        grammar = compile_tool_calls(engine.grammars, [*FUNCTIONS, NESTED, TREE],
                                     ToolChoice("required"), False)
        tree = compile_tool_calls(engine.grammars, [NESTED, TREE], ToolChoice("function", "tree"),
                                  False)
        for seed, rid in enumerate(ids):
            prompt = tuple(random.Random(seed).randrange(32, 127) for _ in range(12))
            sampling = SamplingParams(max_tokens=400, temperature=1.0, seed=seed)
            engine.submit(GenerationRequest(rid, prompt, sampling,
                                            grammar=tree if seed % 2 else grammar), got.sink)
        got.wait(*ids)
    finally:
        engine.stop()
    by_name = {f.name: f for f in [*FUNCTIONS, NESTED, TREE]}
    children = []
    for rid in ids:
        assert got.last(rid).finish_reason == "stop", got.text(rid)
        content, calls = parse_tool_calls(got.text(rid), set(by_name))
        assert content is None and len(calls) == 1, got.text(rid)
        arguments = json.loads(calls[0].arguments)
        jsonschema.validate(arguments, by_name[calls[0].name].parameters)
        if calls[0].name == "tree":
            children.append(arguments["child"])
    assert any(child is not None for child in children), "the recursion was taken"
