"""Reading a JSON object into its body model: a 400 that names the field path, what was wrong
and what is allowed; and the unknown fields that were ignored.

pydantic reports an error's location with the tags of the unions it went through
(`messages.0.user.content.array.0.text`); `param_path` walks the model's core schema beside the
location to drop them (`messages[0].content[0].text`) and to find the schema that refused the
value, from which the message says what is allowed ("a number from 0 to 2", one of the roles).
Only the first error is reported, as OpenAI reports one.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from runtime.limits import describe_range
from server.errors import ApiError, invalid

Body = TypeVar("Body", bound=BaseModel)
log = logging.getLogger("fairtick.server")
IGNORED_FIELDS_HEADER = "fairtick-ignored-fields"
MAX_HEADER_FIELDS = 16  # named in the header; the log line names them all
# A path longer than this is named by its start (a client's key may be any length), and the
# names stop before the header passes MAX_HEADER_BYTES: clients refuse header lines past 64 KiB
# (Python's http.client) and proxies past 4-8 KiB.
MAX_HEADER_NAME_CHARS = 64
MAX_HEADER_BYTES = 4096


def show(value: Any, limit: int = 40, whole_string: bool = True) -> str:
    """A short JSON rendering of a client's value for an error message (a long string as its
    length, or cut short with `whole_string=False`)."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    if isinstance(value, str) and len(value) > limit and whole_string:
        return f"a string of {len(value)} characters"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_body(model: type[Body], data: dict[str, Any], context: dict[str, Any] | None = None
              ) -> Body:
    """`data` as a `model`, or a 400 ApiError for its first invalid field."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise body_error(model, exc.errors(include_url=False)[0]) from None


def body_error(model: type[BaseModel], error: Any) -> ApiError:
    """The 400 for one pydantic error: `param` is the field path, the message says what was
    wrong and what is allowed."""
    path, schema, is_key = param_path(model.__pydantic_core_schema__, error["loc"])
    defs = definitions(model.__pydantic_core_schema__)
    kind, value = error["type"], error.get("input")
    ctx = error.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = ctx.get("discriminator", "").strip("'")
        path = f"{path}.{tag}" if path else tag
        allowed = "one of " + ", ".join(json.dumps(t) for t in (schema or {}).get("choices", {}))
        if isinstance(value, dict) and tag in value:
            what = f"must be {allowed}, got {show(value[tag])}"
        else:
            what = f"is required: {allowed}"
    elif kind == "missing":
        what = f"is required: {allowed_values(schema, error, defs)}"
    elif kind == "value_error":
        what = str(ctx.get("error", error["msg"]))
    else:
        got = f"{_length(ctx, value)} items" if kind in ("too_long", "too_short") else show(value)
        what = f"must be {allowed_values(schema, error, defs)}" + ("" if is_key else f", got {got}")
    if is_key:
        what = f"key {show(value, whole_string=False)} {what}"
    return invalid(f"`{path or 'body'}` {what}", path or None)


def _length(ctx: dict[str, Any], value: Any) -> Any:
    # pydantic leaves a dict's length out of its too_long error (actual_length None).
    length = ctx.get("actual_length")
    return len(value) if length is None and isinstance(value, (dict, list)) else length


def definitions(schema: Any) -> dict[str, Any]:
    """The schemas a model's core schema refers to by `ref`."""
    return {d["ref"]: d for d in schema.get("definitions", ())}


def param_path(schema: Any, loc: tuple[int | str, ...]) -> tuple[str, Any, bool]:
    """(the field path of `loc`, the core schema found there, whether a dict key is at fault)."""
    defs = definitions(schema)
    path = ""
    node: Any = schema
    is_key = False
    for index, step in enumerate(loc):
        node = _unwrap(node, defs)
        kind = node.get("type") if node else None
        if kind == "tagged-union":  # a union's tag: not part of the client's path
            node = node["choices"].get(step)
            continue
        if step == "[key]":
            continue
        if kind == "dict" and loc[index + 1:index + 2] == ("[key]",):  # the key itself is wrong
            node, is_key = node.get("keys_schema"), True
            continue
        path += f"[{step}]" if isinstance(step, int) else (f".{step}" if path else str(step))
        if kind == "model-fields":
            node = _field_schema(node, str(step))
        elif kind == "list":
            node = node.get("items_schema")
        elif kind == "dict":
            node = node.get("values_schema")
        else:
            node = None
    return path, _unwrap(node, defs), is_key


def _field_schema(node: dict[str, Any], name: str) -> Any:
    for field_name, field in node["fields"].items():
        if name in (field_name, field.get("validation_alias")):
            return field["schema"]
    return None


_WRAPPERS = ("model", "nullable", "default", "function-after", "function-before",
             "function-wrap", "definitions")


def _unwrap(node: Any, defs: dict[str, Any]) -> Any:
    """Through optional, defaulted, validated and referenced schemas to the one that decides."""
    while node is not None:
        if node.get("type") == "definition-ref":
            node = defs.get(node["schema_ref"])
        elif node.get("type") in _WRAPPERS:
            node = node["schema"]
        else:
            return node
    return None


_TYPES = {"str": "a string", "bool": "true or false", "model-fields": "an object",
          "dict": "an object", "list": "a list"}
_ITEMS = {"int": "integers", "float": "numbers", "str": "strings", "bool": "booleans",
          "model-fields": "objects", "tagged-union": "objects", "dict": "objects",
          "list": "lists"}


def allowed_values(schema: Any, error: Any, defs: dict[str, Any]) -> str:
    """What the schema at an error's place allows, in words."""
    node = schema or {}
    node_type = node.get("type")
    if node_type in ("int", "float"):
        low = node.get("ge", node.get("gt"))
        return describe_range(node_type == "int", low, node.get("le"), "gt" in node)
    if node_type == "literal":
        choices = [json.dumps(v) for v in node["expected"]]
        return choices[0] if len(choices) == 1 else "one of " + ", ".join(choices)
    if node_type == "tagged-union":
        if node.get("custom_error_message"):
            return str(node["custom_error_message"])
        tags = ", ".join(json.dumps(t) for t in node["choices"])
        return f"an object whose `{node.get('discriminator')}` is one of {tags}"
    what = _TYPES.get(node_type or "", "")
    low, high = node.get("min_length") or 0, node.get("max_length")
    unit = "characters" if node_type == "str" else "items"
    if node_type == "list":
        unit = _ITEMS.get((_unwrap(node.get("items_schema"), defs) or {}).get("type"), "items")
        what = f"a list of {unit}" if not (low or high) else what
    if not what:
        return str(error["msg"]).removeprefix("Input should be ")
    if high is not None:
        return f"{what} of {low} to {high} {unit}" if low else f"{what} of at most {high} {unit}"
    if low == 1:
        return what.replace("a ", "a non-empty ", 1)
    return f"{what} of at least {low} {unit}" if low else what


def ignored_fields(model: BaseModel, path: str = "") -> list[str]:
    """The paths of the unknown fields in a validated body (`user_id`, `messages[1].cache`)."""
    found = [f"{path}.{key}" if path else key for key in (model.model_extra or {})]
    for name, field in type(model).model_fields.items():
        where = f"{path}.{field.alias or name}" if path else (field.alias or name)
        found += _ignored_in(getattr(model, name), where)
    return found


def _ignored_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return ignored_fields(value, path)
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _ignored_in(item, f"{path}[{i}]")]
    return []


def ignored_header(paths: list[str]) -> dict[str, str]:
    """The response header naming the ignored fields (percent-encoded: a client's key may hold
    any character, a header may not): at most MAX_HEADER_FIELDS, a path longer than
    MAX_HEADER_NAME_CHARS by its start and "...", the value within MAX_HEADER_BYTES; empty when
    none was ignored."""
    if not paths:
        return {}
    names: list[str] = []
    for path in paths[:MAX_HEADER_FIELDS]:
        cut = path if len(path) <= MAX_HEADER_NAME_CHARS else path[:MAX_HEADER_NAME_CHARS] + "..."
        name = urllib.parse.quote(cut, safe="[]._-~:@!$&'()*+;=/")
        if names and len(", ".join([*names, name])) > MAX_HEADER_BYTES:
            break
        names.append(name)
    more = len(paths) - len(names)
    value = ", ".join(names) + (f", ... ({more} more)" if more > 0 else "")
    return {IGNORED_FIELDS_HEADER: value}


def log_ignored(where: str, paths: list[str] | tuple[str, ...]) -> None:
    """One warning naming the ignored fields of a request (`where`: its id or route), each
    escaped as JSON: a client's key may hold line breaks."""
    if paths:
        log.warning("%s: ignored unknown fields %s", where, json.dumps(list(paths)))
