"""Chat messages in OpenAI's shapes, declared once as pydantic models, and their text.

Each role has its own model, chosen by `role` (a bad role is one error naming
`messages[i].role` and the roles allowed). Content is a string or a list of parts chosen by
`type`. Image, audio, file and refusal parts are declared so that their shapes are checked;
server/unimplemented.py then refuses them (the engine takes text only). An assistant turn's
`tool_calls` and `tool` turns (with the `tool_call_id` they answer, as OpenAI requires) are
taken.
`prompt_messages` turns accepted messages into the dicts a chat template takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class Strict(BaseModel):
    """Base of every request-body model: JSON types as sent (no "1" for 1, no true for 1, no 1.0
    for an integer), finite numbers, and unknown fields kept aside in `model_extra`, to be ignored
    and reported (ADR 0010)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, frozen=True)


def json_kind(value: Any) -> str | None:
    """The JSON type of a value, the tag of a union chosen by it (None: no member fits)."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return None


def by_json_kind(allowed: str, kind: Callable[[Any], str | None] = json_kind) -> Discriminator:
    """A union whose member is chosen by `kind(value)` (the JSON type by default); a value no
    member takes is one error saying it must be `allowed`."""
    return Discriminator(kind, custom_error_type="wrong_json_type", custom_error_message=allowed)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageUrl(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(Strict):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(Strict):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(Strict):
    type: Literal["file"]
    file: FileRef


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]
TEXT_CONTENT = "a string or a list of text parts"
TextContent = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[TextPart], Field(min_length=1), Tag("array")],
    by_json_kind(TEXT_CONTENT)]
UserContent = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[UserPart], Field(min_length=1), Tag("array")],
    by_json_kind("a string or a list of content parts")]
AssistantContent = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[AssistantPart], Field(min_length=1),
              Tag("array")],
    by_json_kind("a string or a list of text or refusal parts")]


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it (server/tool_request.py checks it is an object)


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(Strict):
    role: Literal["system"]
    content: TextContent
    name: str | None = None


class DeveloperMessage(Strict):
    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: AssistantContent | None = None  # null when the turn was only tool calls
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # OpenAI's deprecated form of one tool call


class ToolMessage(Strict):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str  # the assistant's call this answers; OpenAI requires it


Message = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role")]


def message_text(message: Message) -> str:
    """The text of a message whose parts are all text (others are refused before this)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, TextPart))


def prompt_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Role and text of each message for a chat template (`developer` is OpenAI's newer name
    for `system`), with an assistant turn's `tool_calls` in OpenAI's shape and a tool turn's
    `tool_call_id` (server/tool_request.py `chat_inputs` renders them for the template)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": message_text(m)}
        if isinstance(m, AssistantMessage) and m.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out
