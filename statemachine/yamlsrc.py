"""Read a YAML spec and remember where each value came from, so spec errors can name the line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


class SpecError(ValueError):
    """A spec that cannot be used: names the file, the line, the field and what was expected."""

    def __init__(self, file: str, line: int | None, field: str, message: str) -> None:
        self.file, self.line, self.field, self.message = file, line, field, message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {field}: {message}")


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
    """Parse a YAML file; a syntax error becomes a SpecError with its line."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(file, None, "<file>", f"cannot read: {exc.strerror}") from exc
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise SpecError(file, line, "<yaml>", f"not valid YAML: {exc}") from exc
    lines: dict[Path_, int] = {}
    data = _convert(node, (), lines, file) if node is not None else None
    return Source(file, data, lines)


def _convert(node: yaml.Node, path: Path_, lines: dict[Path_, int], file: str) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = yaml.SafeLoader("").construct_object(key_node)  # scalars only
            if not isinstance(key, str | int | bool):
                raise SpecError(file, key_node.start_mark.line + 1, ".".join(map(str, path)),
                                "mapping keys must be plain names")
            key = str(key)
            if key in out:
                raise SpecError(file, key_node.start_mark.line + 1, key, "duplicate key")
            out[key] = _convert(value_node, (*path, key), lines, file)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), lines, file) for i, item in enumerate(node.value)]
    return yaml.SafeLoader("").construct_object(node)
