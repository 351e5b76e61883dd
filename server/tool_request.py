"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request, in OpenAI's shapes, and the
messages and tool list a chat template is rendered with (server/tool_calls.py has the format).

With tools offered and `tool_choice` other than "none", the prompt offers them: through the
model's chat template when it writes Hermes calls, else through a system message; "required" or
a named function is then enforced by a grammar, "auto" leaves the model free and its calls are
read from what it writes. "none" (the default without tools) renders no tools.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from server.body_models import ChatBody, NamedToolChoice, TokenizeBody
from server.body_reading import show
from server.errors import invalid
from server.tool_calls import (
    NO_PARAMETERS,
    OPEN,
    Function,
    ToolChoice,
    loads_as_written,
    render_call,
    tool_format,
    tools_system_prompt,
)


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and how the model may use them."""

    functions: tuple[Function, ...]
    choice: ToolChoice
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}


def read_tool_request(body: ChatBody | TokenizeBody) -> ToolRequest | None:
    """The tools a validated body offers (None: none, or `tool_choice` "none"; /tokenize has no
    `tool_choice`: its tools are offered as "auto" offers them), or a 400 naming the part that
    is wrong. The body model checked the shapes; this checks what they mean
    together: names given once, a named `tool_choice` among the `tools`, and `parameters` a
    schema of an object (none, or `{}`, takes `{}`; a schema without "type" gets "object")."""
    functions: list[Function] = []
    for i, tool in enumerate(body.tools or ()):
        function = tool.function
        if function.name in {f.name for f in functions}:
            raise invalid(f"`tools[{i}].function.name` {function.name!r} is given twice",
                          f"tools[{i}].function.name")
        parameters = _object_schema(function.parameters, f"tools[{i}].function.parameters")
        functions.append(Function(function.name, function.description, parameters))
    value = getattr(body, "tool_choice", None)
    choice = _read_choice(value, {f.name for f in functions})
    if choice.mode == "none":
        return None
    return ToolRequest(tuple(functions), choice, getattr(body, "parallel_tool_calls", None)
                       is not False)


def _object_schema(parameters: dict[str, Any] | None, param: str) -> dict[str, Any]:
    # OpenAI: arguments are always a JSON object, and leaving `parameters` out declares none.
    # The grammar, the reply parser and a client's calls sent back all take an object only.
    if not parameters:
        return copy.deepcopy(NO_PARAMETERS)
    if "type" not in parameters:
        return {"type": "object", **parameters}
    if parameters["type"] != "object":
        raise invalid(f"`{param}` has \"type\" {show(parameters['type'])}: a function's "
                      "arguments are a JSON object, so its schema's \"type\" must be \"object\" "
                      "(or left out)", param)
    return parameters


def _read_choice(value: Any, names: set[str]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(value, NamedToolChoice):
        choice = ToolChoice("function", value.function.name)
        if choice.name not in names:
            raise invalid(f"`tool_choice.function.name` {choice.name!r} is not one of the "
                          f"`tools`: {sorted(names)}", "tool_choice.function.name")
    else:
        choice = ToolChoice(value)
    if choice.mode != "none" and not names:
        raise invalid(f"`tool_choice` {show(value if isinstance(value, str) else choice.name)} "
                      "needs `tools`", "tool_choice")
    return choice


def chat_inputs(messages: list[dict[str, Any]], tools: ToolRequest | None,
                chat_template: str | None) -> tuple[list[dict[str, Any]],
                                                    list[dict[str, Any]] | None]:
    """The messages and the tool list to render the prompt with; a 400 when tools are offered
    to a model whose template writes calls in a format fairtick does not read, when an
    earlier call's arguments are not a JSON object (a template writes them as one), or when a
    tool message answers no call of the assistant message before it."""
    _check_arguments(messages)
    _check_tool_turns(messages)
    how = tool_format(chat_template)
    if tools is not None and how is None:
        raise invalid("`tools` are not supported for this model: its chat template writes tool "
                      f"calls in a format other than {OPEN} blocks", "tools")
    if how == "template":
        return [_for_template(m) for m in messages], _tool_specs(tools)
    rendered = [_as_text(m) for m in messages]
    if tools is not None:
        rendered.insert(0, {"role": "system", "content": tools_system_prompt(
            list(tools.functions))})
    return rendered, None


def _check_arguments(messages: list[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls", ())):
            arguments = call["function"]["arguments"]
            try:
                # As the server writes them: numbers past the float range are kept.
                is_object = isinstance(loads_as_written(arguments), dict)
            except ValueError:
                is_object = False
            if not is_object:
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise invalid(f"`{param}` must be a JSON object as a string, got "
                              f"{show(arguments)}", param)


def _check_tool_turns(messages: list[dict[str, Any]]) -> None:
    # As OpenAI: a tool message answers one of the calls of the assistant message before it
    # (tool messages between them answer its other calls).
    asked: tuple[int, list[str]] | None = None  # the assistant message answered: its index, ids
    for i, message in enumerate(messages):
        if message["role"] != "tool":
            calls = message.get("tool_calls")
            asked = (i, [call["id"] for call in calls]) if calls else None
        elif asked is None:
            raise invalid(f"`messages[{i}]` has role \"tool\" but does not follow an assistant "
                          "message with `tool_calls`: a tool message answers one of its calls",
                          f"messages[{i}].role")
        elif message["tool_call_id"] not in asked[1]:
            param = f"messages[{i}].tool_call_id"
            raise invalid(f"`{param}` is {show(message['tool_call_id'])}, which is no call of "
                          f"the assistant message it answers (messages[{asked[0]}]); its calls' "
                          f"ids: {', '.join(show(x) for x in asked[1])}", param)


def _tool_specs(tools: ToolRequest | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    return [{"type": "function", "function": {
        "name": f.name, **({"description": f.description} if f.description else {}),
        "parameters": f.parameters}} for f in tools.functions]


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    # Templates read a call's arguments as a mapping (they write it with tojson).
    if "tool_calls" not in message:
        return message
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _as_text(message: dict[str, Any]) -> dict[str, str]:
    # The fallback template renders role and content only: calls and results become text.
    if "tool_calls" in message:
        blocks = [render_call(c["function"]["name"], c["function"]["arguments"])
                  for c in message["tool_calls"]]
        text = "\n".join(filter(None, [message["content"], *blocks]))
        return {"role": "assistant", "content": text}
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message['content']}\n"
                                           "</tool_response>"}
    return {"role": message["role"], "content": message["content"]}
