"""The built-in model, written once per test session into a temporary cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.model import ModelBundle, load_model, make_builtin_model


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fairtick-cache")


@pytest.fixture(scope="session")
def bundle(cache_dir: Path) -> ModelBundle:
    return load_model(make_builtin_model(cache_dir))


@pytest.fixture(scope="session")
def eos_bundle(cache_dir: Path) -> ModelBundle:
    """A variant whose output layer lets EOS through, to test stopping."""
    return load_model(make_builtin_model(cache_dir, allow_eos=True))
