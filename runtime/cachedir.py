"""Where fairtick keeps what it builds once: the built-in model and the BLAS shim."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CACHE_ENV = "FAIRTICK_CACHE"


def default_cache_dir() -> Path:
    """$FAIRTICK_CACHE, else ~/.cache/fairtick."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "fairtick"


def usable_cache_dir() -> Path:
    """The cache directory, made if missing; ValueError naming it ($FAIRTICK_CACHE where set)
    and why when it cannot be made or written (a file of that name, a missing parent that
    cannot be made, no permission)."""
    path = default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        named = f"${CACHE_ENV}={os.environ[CACHE_ENV]!r}" if os.environ.get(CACHE_ENV) else \
            f"{path} (the default; ${CACHE_ENV} names another)"
        why = "it is a file, not a directory" if path.is_file() else exc.strerror or str(exc)
        raise ValueError(f"the cache directory {named} cannot be used: {why}") from exc
    return path
