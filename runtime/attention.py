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

The softmax: MLX's CPU `exp` costs ~22 ns an element here (numpy's ~4), most of a prompt
slice's attention at long context. `softmax` computes exp(x - max) as (P(y / 64))^64, P the
degree-7 Taylor polynomial of exp on [-1.25, 0], in one kernel that MLX's `mx.compile` fuses
and builds with the C++ compiler: up to 2.4x faster than `mx.softmax` on score blocks that
fit in cache (~1x on blocks of tens of MB, memory-bound either way), its error against a
float64 softmax the same order as MLX's own (7e-6 vs 4e-6 at 2,000 keys, 3.8e-5 vs 3.6e-5 at
8,000: rounding of the sum dominates both; tests/runtime/test_attention.py). Without a C++
compiler MLX runs the kernel's ops one by one (slower than `mx.softmax`), so then, or with
$FAIRTICK_SOFTMAX=exact, `softmax` is MLX's own and `attend` is bit-equal to the fallback as
above (ADR 0014).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

SOFTMAX_ENV = "FAIRTICK_SOFTMAX"
SOFTMAX_SETTINGS = ("auto", "exact")
# exp(-80) ~ 2e-35: weights below it are 0 (also masked keys, whose scores are -inf).
_UNDERFLOW = -80.0
_SQUARINGS = 6  # exp(y) = exp(y / 64)^64


def fast_softmax_reason() -> str | None:
    """Why `softmax` is MLX's own here (None: the fast kernel is used)."""
    setting = os.environ.get(SOFTMAX_ENV, "auto")
    if setting not in SOFTMAX_SETTINGS:
        raise ValueError(f"${SOFTMAX_ENV}={setting!r}: expected one of {SOFTMAX_SETTINGS}")
    if setting == "exact":
        return f"${SOFTMAX_ENV}=exact"
    if mx.default_device() != mx.cpu:
        return "not on the CPU"
    if shutil.which("g++") is None:
        return "no g++ to build MLX's compiled kernels"
    return None


def _shifted_exp(scores: mx.array, most: mx.array) -> mx.array:
    y = scores - most  # <= 0
    z = y * (1.0 / 2**_SQUARINGS)
    p = 1 + z * (1 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z * (
        1 / 720 + z * (1 / 5040)))))))
    for _ in range(_SQUARINGS):
        p = p * p
    return mx.where(y < _UNDERFLOW, mx.array(0.0, p.dtype), p)


_fused_shifted_exp = mx.compile(_shifted_exp, shapeless=True)
FAST_SOFTMAX = fast_softmax_reason() is None


def warm_up() -> None:
    """Build the fast softmax's kernel now, not in a request's first tick: the C++ compiler
    takes ~8 s on a machine's first run (MLX keeps the kernel on disk for later processes, and
    one shapeless kernel serves every shape of as many dimensions: `attend`'s scores are 4-D).
    MLX keeps compiled functions per thread, so a thread that runs the forward calls this too:
    tracing there makes the few scalar constants the trace keeps before any baseline of MLX's
    memory is taken."""
    fast_softmax_reason()  # a bad $FAIRTICK_SOFTMAX is refused, as at import
    if FAST_SOFTMAX:
        mx.eval(softmax(mx.zeros((1, 1, 2, 3))))


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, in float32 (as MLX's precise softmax computes half-precision
    scores): the fast kernel where it can be built, else MLX's own."""
    if not FAST_SOFTMAX:
        return mx.softmax(scores, axis=-1, precise=True)
    dtype = scores.dtype
    if dtype != mx.float32:
        scores = scores.astype(mx.float32)
    weights = _fused_shifted_exp(scores, mx.max(scores, axis=-1, keepdims=True))
    weights = weights / mx.sum(weights, axis=-1, keepdims=True)
    return weights if dtype == mx.float32 else weights.astype(dtype)


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
    return (softmax(scores) @ values).reshape(batch, num_heads, length, -1)


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
