"""Copies of a prompt's KV cache for its sibling choices (`n` > 1): nothing is computed again.

A `KVCache` is copied lazily: the copy is a new cache whose arrays view the same keys and values
up to its offset, so the memory is shared until one of them is written. MLX writes into a
buffer in place only when no other array uses it and copies it first otherwise, so no cache
ever sees another's writes; the decode batch's merge gives each sibling a row of its own. Any
other cache type (rotating, quantized, ...) is deep-copied.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.models.cache import KVCache


def fork_cache(cache: list[Any]) -> list[Any]:
    """A copy of a sequence's cache (one entry per layer) that evolves independently."""
    out: list[Any] = []
    for layer in cache:
        if type(layer) is KVCache and layer.keys is not None:
            twin = KVCache()
            end = layer.offset
            twin.keys, twin.values = layer.keys[..., :end, :], layer.values[..., :end, :]
            twin.offset = end
            out.append(twin)
        else:
            out.append(copy.deepcopy(layer))
    return out
