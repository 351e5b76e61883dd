"""Where fairtick keeps what it builds once: the built-in model and the BLAS shim."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$FAIRTICK_CACHE, else ~/.cache/fairtick."""
    env = os.environ.get("FAIRTICK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fairtick"
