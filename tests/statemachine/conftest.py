"""Helpers for writing policy specs in tests: a shipped spec with some fields changed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from statemachine.spec import POLICIES_DIR


@pytest.fixture
def variant(tmp_path: Path) -> Callable[..., Path]:
    """`variant("deadline", claims={"wait_ticks": "max_wait"})` writes a changed copy of a
    shipped policy spec and returns its path."""

    def make(base: str, **changes: Any) -> Path:
        doc = yaml.safe_load((POLICIES_DIR / f"{base}.yaml").read_text())
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key] = {**doc[key], **value}
            else:
                doc[key] = value
        doc["name"] = f"{base}_variant"
        path = tmp_path / f"{base}_variant.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return make
