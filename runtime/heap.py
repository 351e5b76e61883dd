"""Handing freed memory back to the system once the engine holds no sequence.

MLX frees arrays into its buffer cache (emptied by `mx.clear_cache`) and from there into the C
allocator, which on glibc keeps the freed pages in its arenas (one per thread that allocated):
after a burst of requests the server's RSS stayed near the burst's peak (300 streams, half of
them cut, at default flags: +120-430 MiB, reused by the next burst but never returned).
`malloc_trim(0)` returns them. Where the C library has no `malloc_trim` (macOS, musl) nothing is
done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


def give_back_free_memory() -> bool:
    """Return the C allocator's free pages to the system; False where it cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
