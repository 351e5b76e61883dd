"""Attention of a block of queries against its cache's keys, faster on MLX's CPU than its own.

On the CPU, `mx.fast.scaled_dot_product_attention` runs MLX's op-level fallback: for grouped
queries (more query heads than key heads) it multiplies a 5-D view of the queries by the keys
broadcast over the group, a batched product that MLX's CPU matmul runs one small product per
query head. `attend` folds each group's query heads into the rows of one product per key head
instead, the same dot products of the same numbers, and keeps every other op of the fallback
(scale, mask, precise softmax, values): its output equals the fallback's bit for bit where
the BLAS computes each row of a product alone (the reference BLAS), and to float32 rounding
elsewhere. One token per row at 1,500 keys: 0.82x the fallback's time at 1 row, 0.84x at 16
(scripts/bench_attention_cpu.py); a prompt slice's many tokens gain little (its time is the
softmax's `exp`). Quantized caches and other devices keep mlx-lm's call.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention


def attend(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
           mask: mx.array | str | None) -> mx.array:
    """What mlx-lm's `scaled_dot_product_attention` returns for queries (B, Hq, T, D) against
    keys and values (B, Hkv, C, D); `mask` None, "causal" or an array broadcastable to
    (B, Hq, T, C), boolean (keep) or additive."""
    if hasattr(cache, "bits") or mx.default_device() != mx.cpu:
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                            mask=mask)
    batch, num_heads, length, dim = queries.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    queries = mx.array(scale, queries.dtype) * queries
    scores = queries.reshape(batch, num_kv_heads, group * length, dim) @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = _masked(scores.reshape(batch, num_kv_heads, group, length, num_keys), mask,
                         num_kv_heads, group).reshape(batch, num_kv_heads, group * length,
                                                      num_keys)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(batch, num_heads, length, -1)


def _masked(scores: mx.array, mask: mx.array | str, num_kv_heads: int,
            group: int) -> mx.array:
    # scores (B, Hkv, group, T, C); the mask as the fallback applies it.
    length, num_keys = scores.shape[-2:]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}: an array, 'causal' or None")
        start = max(num_keys - length, 0)
        mask = mx.arange(start, start + length)[:, None] >= mx.arange(num_keys)[None]
    elif mask.ndim >= 3:
        mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mask.reshape(
            *mask.shape[:-3], num_kv_heads, group, *mask.shape[-2:])
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
    return scores + mask.astype(scores.dtype)
