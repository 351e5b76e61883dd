"""A phase's result: a two-column table and its verdict, printed as Markdown or written as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class PhaseResult:
    """One phase's table rows and the failures that make it FAIL (none: PASS)."""

    name: str
    rows: list[tuple[str, Any]]
    failures: list[str]

    def print(self) -> None:
        print(f"\n## {self.name}\n")
        width = max(len(label) for label, _ in self.rows)
        print(f"| {'what':<{width}} | value |")
        print(f"|{'-' * (width + 2)}|-------|")
        for label, value in self.rows:
            print(f"| {label:<{width}} | {value} |")
        print(f"\nverdict: {'FAIL: ' + '; '.join(self.failures) if self.failures else 'PASS'}")


def write_json(results: list[PhaseResult], path: str) -> None:
    """The tables as JSON: one object per phase, every value as its printed string."""
    with open(path, "w") as out:
        json.dump([{"phase": r.name, "rows": [[k, str(v)] for k, v in r.rows],
                    "failures": r.failures} for r in results], out, indent=1)
