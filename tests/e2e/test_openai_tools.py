"""Tool calls through the real server with the real `openai` client, whole and streamed.

The built-in model's template takes no tools, so they are offered by the fallback system message;
its free output is noise, so every well-formed call under "required" or a named function comes
from the grammar, and under "auto" it writes text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.server.http_helpers import post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
    "strict": True}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object",
                   "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Bonn?"}]


@pytest.fixture
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed(client, **kwargs):
    """The message a client assembles from the deltas, and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_choice_gets_well_formed_tool_calls(client, model_name, choice):
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    args = dict(model=model_name, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=False, max_tokens=300)
    out = client.chat.completions.create(**args)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    check_calls(message.tool_calls, names)
    assert len(message.tool_calls) == 1
    content, calls, finish = streamed(client, **args)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]  # greedy
    # The SDK's stream helper assembles what the whole response has: no content (the role
    # delta's content is null, not "", for a turn that can only be calls).
    with client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0].message
    assert final.content is None and [c.function.arguments for c in final.tool_calls] == \
        [c.function.arguments for c in message.tool_calls]


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_is_a_call_whose_arguments_stop_there(
        client, model_name, choice):
    # The output is cut inside its call block: the client gets that call (its arguments as far
    # as written, not JSON yet) and finish_reason "length", never the block's markup as text.
    args = dict(model=model_name, messages=MESSAGES, tools=[WEATHER], tool_choice=choice,
                parallel_tool_calls=False)
    whole = client.chat.completions.create(max_tokens=300, **args).choices[0].message
    assert len(whole.tool_calls) == 1
    written = whole.tool_calls[0].function.arguments
    # The block's head is ~45 one-byte tokens: 60 stops inside the arguments.
    out = client.chat.completions.create(max_tokens=60, **args).choices[0]
    assert out.finish_reason == "length" and out.message.content is None
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments and written.startswith(call.function.arguments)
    assert call.function.arguments != written
    content, calls, finish = streamed(client, max_tokens=60, **args)
    assert finish == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [("get_weather", call.function.arguments)]


def test_parallel_calls_sampled(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", max_tokens=1000,
                                         temperature=1.0, seed=5)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls, {"get_weather", "get_time"})


def test_auto_lets_the_noise_model_write_text(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=20)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content


def test_a_conversation_with_calls_and_results_continues(client, model_name, server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Bonn", "unit": "C"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    out = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS,
                                         tool_choice="none", max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    counted = post(server.url, "/tokenize", {"messages": messages}).json()
    assert out.usage.prompt_tokens == counted["count"]
    text = post(server.url, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"]
    assert '"arguments": {"city": "Bonn", "unit": "C"}' in text and "12 C" in text


def test_tokenize_counts_the_offered_tools_as_the_chat_does(client, model_name, server):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=1)
    counted = post(server.url, "/tokenize", {"messages": MESSAGES, "tools": TOOLS}).json()
    assert out.usage.prompt_tokens == counted["count"]
    bare = post(server.url, "/tokenize", {"messages": MESSAGES}).json()
    assert bare["count"] < counted["count"]


def test_each_choice_of_n_streams_its_own_calls(client, model_name):
    args = dict(model=model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                max_tokens=1000, temperature=1.0, seed=9, n=2)
    whole = client.chat.completions.create(**args)
    assert [c.finish_reason for c in whole.choices] == ["tool_calls"] * 2
    for choice in whole.choices:
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    calls: dict[int, dict[int, dict[str, str]]] = {0: {}, 1: {}}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            for call in c.delta.tool_calls or ():
                calls[c.index][call.index] = {"name": call.function.name,
                                              "arguments": call.function.arguments}
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    for index, choice in enumerate(whole.choices):  # the same seeds: the same calls
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls[index].items())] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


# `parameters: {}` declares no parameters, as leaving it out does; a schema without "type" is
# one of an object. Either way a forced call's arguments are a JSON object.
EMPTY = {"type": "function", "function": {"name": "reset", "parameters": {}}}
TYPELESS = {"type": "function", "function": {"name": "set_zone", "parameters": {
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "reset"}}])
def test_a_function_with_empty_parameters_is_called_with_an_empty_object(client, model_name,
                                                                          choice):
    args = dict(model=model_name, messages=MESSAGES, tools=[EMPTY], tool_choice=choice,
                parallel_tool_calls=False, max_tokens=200)
    out = client.chat.completions.create(**args)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("reset", "{}")]
    content, calls, finish = streamed(client, **args)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("reset", "{}")]


def test_every_choice_calls_functions_with_object_arguments(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                         tools=[EMPTY, TYPELESS, TIME], tool_choice="required",
                                         max_tokens=1000, temperature=1.0, seed=3, n=2)
    schemas = {"reset": {"const": {}}, "set_zone": TYPELESS["function"]["parameters"],
               "get_time": PARAMETERS["get_time"]}
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments, dict)
            jsonschema.validate(arguments, schemas[call.function.name])


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
])
def test_bad_tools_are_400s_naming_the_field(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES,
                                       **{"tools": TOOLS, **fields}, max_tokens=5)
    assert info.value.body["param"] == param
