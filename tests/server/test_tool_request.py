"""`tools`, `tool_choice` and tool messages read from chat bodies (no engine), and the prompt
they render: through a chat template that writes Hermes calls, or through the fallback."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from server.body_models import ChatBody
from server.messages import prompt_messages
from server.prompts import TokenizerEncoder
from server.tool_calls import NO_PARAMETERS, OPEN, Function, ToolChoice
from server.tool_request import chat_inputs, read_tool_request
from server.validation import validate_request
from tests.server.test_validation import encoder, expect, limits


def chat(**fields):
    # A context long enough for the fallback's tool prompt.
    roomy = dataclasses.replace(limits(), context_length=4096)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    return validate_request("chat", body, roomy, encoder())

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": PARAMS, "strict": True}}
PING = {"type": "function", "function": {"name": "ping"}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Bonn"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Bonn?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
]


def tools_of(**fields):
    """The ToolRequest a chat body with `fields` is read into."""
    return read_tool_request(ChatBody.model_validate({"messages": CONVERSATION, **fields}))


def test_tools_and_every_tool_choice():
    body = {"tools": [TOOL, PING]}
    got = chat(**body).tools
    assert got is not None and got.choice == ToolChoice("auto") and got.parallel
    assert got.functions == (Function("get_weather", "Weather", PARAMS),
                             Function("ping", None, NO_PARAMETERS))
    forced = tools_of(**body, tool_choice="required", parallel_tool_calls=False)
    assert forced is not None and forced.choice == ToolChoice("required") and not forced.parallel
    named = {"type": "function", "function": {"name": "ping"}}
    assert tools_of(**body, tool_choice=named).choice == ToolChoice("function", "ping")
    assert tools_of(**body, tool_choice="none") is None
    assert tools_of() is None and tools_of(tools=[]) is None


def test_arguments_are_always_an_object():
    # OpenAI: arguments are a JSON object and `parameters` a schema of one; leaving it out
    # (or sending {}) declares no parameters.
    empty = tools_of(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert empty is not None and empty.functions == (Function("f", None, NO_PARAMETERS),)
    typeless = {"properties": {"city": {"type": "string"}}, "required": ["city"]}
    got = tools_of(tools=[{"type": "function", "function": {"name": "f",
                                                            "parameters": typeless}}])
    assert got is not None and got.functions[0].parameters == {"type": "object", **typeless}
    assert "type" not in typeless, "the body is left as sent"
    assert tools_of(tools=[TOOL]).functions[0].parameters == PARAMS  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["array", "string", "null", ["object", "null"], 5])
def test_parameters_of_another_type_are_a_400(kind):
    tools = [PING, {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}]
    expect(chat, tools=tools, param="tools[1].function.parameters",
           match='arguments are a JSON object, so its schema\'s "type" must be "object"')


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "code"}]}, "tools[0].type", "must be \"function\""),
    ({"tools": [PING] * 129}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "letters"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "must be an object"),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice", "\"required\""),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "is required"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not one of the `tools`"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [TOOL], "tool_choice": "required", "min_tokens": 1}, "min_tokens",
     "forced `tool_choice`"),
])
def test_a_bad_tool_field_is_a_400_naming_it(fields, param, says):
    expect(chat, **fields, param=param, match=says)


def test_the_fallback_offers_tools_in_a_system_message_and_renders_calls_as_text():
    # The built-in model's template takes no tools: the fallback.
    tokens = chat(messages=CONVERSATION, tools=[TOOL]).prompt_tokens
    text = encoder().decode(list(tokens))
    assert text.index('"name": "get_weather"') < text.index("Weather in Bonn?")  # the offer
    assert f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Bonn"}}}}' in text
    assert "<tool_response>\n12 C\n</tool_response>" in text
    assert text.endswith("<|assistant|>\n")
    # tool_choice "none": the conversation alone, as /tokenize renders it.
    without = chat(messages=CONVERSATION, tools=[TOOL], tool_choice="none").prompt_tokens
    assert "get_weather\", \"description" not in encoder().decode(list(without))


HERMES = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nCall with <tool_call>JSON</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_hermes_template_gets_the_tools_and_calls_with_arguments_as_objects():
    tokenizer = copy.deepcopy(encoder().tokenizer)
    tokenizer._tokenizer.chat_template = HERMES
    hermes = TokenizerEncoder(tokenizer)
    tools = tools_of(tools=[TOOL])
    messages, specs = chat_inputs(chat_messages(), tools, hermes.chat_template)
    text = hermes.render_chat(messages, True, specs)
    assert json.dumps(specs[0]) in text  # type: ignore[index]
    assert '"arguments": {"city": "Bonn"}' in text  # an object, not a string of JSON
    assert text.endswith("<|im_start|>assistant\n")


def chat_messages():
    return prompt_messages(ChatBody.model_validate({"messages": CONVERSATION}).messages)


def test_a_template_with_another_call_format_is_refused_with_tools():
    template = "{% if tools %}[TOOL_CALLS]{% endif %}{{ messages }}"
    with pytest.raises(Exception) as info:
        chat_inputs(chat_messages(), tools_of(tools=[TOOL]), template)
    assert getattr(info.value, "param", None) == "tools"
    assert chat_inputs(chat_messages(), None, template)[1] is None
