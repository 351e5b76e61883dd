"""Read a YAML spec and remember where each value came from, so spec errors can name the line.

A spec is a few KB. The loader refuses what is far past that before it costs time or memory
(PyYAML is pure Python here: about 0.1 ms per value and 1 s per 300 KB of text): a file over
`MAX_BYTES`, more than `MAX_VALUES` values, values nested deeper than `MAX_DEPTH` (PyYAML
composes recursively, one Python frame per level), and anchors and aliases (`&name`, `*name`):
no spec needs them, they are how a 500-byte file expands to a billion values or refers to
itself, and a value reached through an alias has no line of its own for an error to name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]

MAX_BYTES = 128 * 1024  # the shipped specs are under 2 KB
MAX_VALUES = 2000  # every scalar, list and mapping; the shipped specs have at most 84
MAX_DEPTH = 32  # the shipped specs nest 5 levels deep
EXCERPT_CHARS = 60


class SpecError(ValueError):
    """A spec that cannot be used: names the file, the line, the field and what was expected."""

    def __init__(self, file: str, line: int | None, field: str, message: str) -> None:
        self.file, self.line, self.field, self.message = file, line, field, message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {field}: {message}")


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` cut to its first `limit` characters (then "…"), so an error quoting a long
    expression or line stays short."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass(frozen=True)
class Source:
    """A loaded YAML document plus the line of every value in it (1-based)."""

    file: str
    data: Any
    lines: dict[Path_, int]

    def line(self, path: Path_) -> int | None:
        """The line of `path`, or of its nearest parent that has one."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), 1)

    def error(self, path: Path_, message: str) -> SpecError:
        field = ".".join(str(p) for p in path) or "<document>"
        return SpecError(self.file, self.line(path), field, message)


def load_source(path: str | Path) -> Source:
    """Parse a YAML file within the limits above; every problem becomes a SpecError with its
    line."""
    file = str(path)
    text = _read(path, file)
    try:
        loader = _BoundedLoader(text, file)  # checks the characters at once
        node = loader.get_single_node()
        lines: dict[Path_, int] = {}
        data = _convert(loader, node, (), lines) if node is not None else None
        loader.dispose()
    except yaml.YAMLError as exc:
        raise SpecError(file, _line_of(exc, text), "<yaml>", f"not valid YAML: {exc}") from exc
    return Source(file, data, lines)


def _line_of(exc: yaml.YAMLError, text: str) -> int | None:
    if isinstance(exc, yaml.reader.ReaderError):  # a control character
        return text.count("\n", 0, exc.position) + 1
    mark = getattr(exc, "problem_mark", None)
    return mark.line + 1 if mark is not None else None


def _read(path: str | Path, file: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # never more, whatever the file is (/dev/zero)
    except OSError as exc:
        raise SpecError(file, None, "<file>", f"cannot read: {exc.strerror}") from exc
    if len(raw) > MAX_BYTES:
        raise SpecError(file, None, "<file>", f"is larger than {MAX_BYTES // 1024} KiB, the "
                        "most a spec may be (the shipped specs are under 2 KB)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecError(file, line, "<file>", f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                        f"at offset {exc.start})") from exc


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors, aliases, nesting past MAX_DEPTH and values past
    MAX_VALUES as each node is reached, before composing what lies below it."""

    def __init__(self, text: str, file: str) -> None:
        super().__init__(text)
        self.text, self.file = text, file
        self.fields: list[str] = []  # the field being composed, from the root ("" for keys)
        self.num_values = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]
        label = str(index) if isinstance(index, int) else \
            index.value if isinstance(index, yaml.ScalarNode) else ""
        self.fields.append(label)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            what = f"alias *{anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{anchor}"
            raise self._error(event, f"{what}: anchors and aliases are not supported in specs; "
                              "write the value out")
        if len(self.fields) > MAX_DEPTH:
            raise self._error(event, f"nested deeper than {MAX_DEPTH} levels (lists and "
                              "mappings inside each other); a spec needs about 5")
        self.num_values += 1
        if self.num_values > MAX_VALUES:
            raise self._error(event, f"more than {MAX_VALUES} values (scalars, lists and "
                              "mappings); a spec has about 100")
        node = super().compose_node(parent, index)
        self.fields.pop()
        return node

    def _error(self, event: yaml.Event, message: str) -> SpecError:
        field = ".".join(f for f in self.fields if f) or "<document>"
        line = event.start_mark.line if event.start_mark is not None else 0
        text_lines = self.text.splitlines()
        near = text_lines[line] if line < len(text_lines) else ""
        return SpecError(self.file, line + 1, excerpt(field, 40), f"{message}; near "
                         f"{excerpt(near)!r}")


def _convert(loader: _BoundedLoader, node: yaml.Node, path: Path_,
             lines: dict[Path_, int]) -> Any:
    # Recursion is bounded: the loader refused nesting past MAX_DEPTH and every alias.
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _scalar(loader, key_node, path) if isinstance(key_node, yaml.ScalarNode) \
                else None
            if not isinstance(key, str | int | bool):
                raise SpecError(loader.file, key_node.start_mark.line + 1,
                                ".".join(map(str, path)) or "<document>",
                                "mapping keys must be plain names")
            key = str(key)
            if key in out:
                raise SpecError(loader.file, key_node.start_mark.line + 1,
                                ".".join(map(str, (*path, key))), "duplicate key")
            out[key] = _convert(loader, value_node, (*path, key), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(loader, item, (*path, i), lines) for i, item in enumerate(node.value)]
    return _scalar(loader, node, path)


def _scalar(loader: _BoundedLoader, node: yaml.Node, path: Path_) -> Any:
    if node.tag == "tag:yaml.org,2002:merge":
        message = "merge keys (<<) are not supported in specs; write the keys out"
    else:
        try:
            return loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:  # an unknown tag such as !!python/name
            problem = getattr(exc, "problem", None) or str(exc)
            message = f"cannot read {excerpt(str(node.value))!r}: {problem}"
        except ValueError as exc:  # !!int abc, an integer of over 4300 digits
            message = f"cannot read {excerpt(str(node.value))!r} as {node.tag}: " \
                      f"{excerpt(str(exc), 80)}"
    raise SpecError(loader.file, node.start_mark.line + 1,
                    ".".join(map(str, path)) or "<document>", message)
