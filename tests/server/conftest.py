"""The built-in model, loaded once per test module (it is tiny: ~1M parameters)."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.model import load_model


@pytest.fixture(scope="module")
def bundle() -> Any:
    return load_model(None)
