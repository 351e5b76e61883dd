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
slice's attention at long context. The fast path computes exp(x - max) as (P(y / 64))^64, P the
degree-7 polynomial of exp on [-1.25, 0] in Estrin's form, y clamped to >= -80, in one kernel
that MLX's `mx.compile` fuses and builds with the C++ compiler (vectorized: a select there, or a
Horner chain deep enough to be split over two kernels, runs it 1.5-2x slower). Masked keys
(-inf) and keys 80 or more below the max get exp(-80) ~ 1.8e-35 of the max key's weight, which
no float32 sum of weights >= 1 can register. It then skips two passes over the score block:
a slice's causal mask is applied to its own t x t block only (every query sees every cached
key), and the weighted values are divided by the weights' sum (t x d numbers) instead of the
weights (t x keys). One layer at 10,000 keys: ~0.45x the previous fast path for an 8-token
slice, ~0.4x for 16, about the same for one token a row (scripts/bench_attention_cpu.py; ADR
0014 revision 2). Its error against float64 is the same order as MLX's own (tests/runtime/
test_attention.py). Without a C++ compiler MLX runs the kernel's ops one by one (slower than
`mx.softmax`), so then, or with $FAIRTICK_SOFTMAX=exact, `attend` is the fallback's ops with
MLX's softmax and bit-equal to it as above (ADR 0014).

With the fast softmax, a float32 prompt slice's attention goes to one C++ primitive instead of
those ops where it can be built (runtime/native.py, ADR 0015: 0.2-0.4x their time), and so do
float32 decode rows whose mask is their batch cache's left padding (`rows_kernel_serves`).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache

from runtime import native

SOFTMAX_ENV = "FAIRTICK_SOFTMAX"
SOFTMAX_SETTINGS = ("auto", "exact")
STREAMS_ENV = "FAIRTICK_ATTENTION_STREAMS"
STREAMS_SETTINGS = ("1", "2")
# exp(-80) ~ 1.8e-35: the least weight a key gets (masked keys' scores are -inf).
_UNDERFLOW = -80.0
_SQUARINGS = 6  # exp(y) = exp(y / 64)^64
_TAYLOR = [1 / f for f in (1, 1, 2, 6, 24, 120, 720, 5040)]  # exp's, to degree 7


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
    z = mx.maximum(scores - most, _UNDERFLOW) * (1.0 / 2**_SQUARINGS)  # in [-1.25, 0]
    c = _TAYLOR
    z2 = z * z
    p = (c[0] + c[1] * z) + z2 * (c[2] + c[3] * z) + z2 * z2 * (
        (c[4] + c[5] * z) + z2 * (c[6] + c[7] * z))
    for _ in range(_SQUARINGS):
        p = p * p
    return p


def attention_streams_setting() -> int:
    """How many CPU streams a tick's attention may spread its segments over (runtime/fused.py):
    $FAIRTICK_ATTENTION_STREAMS, 2 unless set to 1; 1 off the CPU or on a single-core machine."""
    setting = os.environ.get(STREAMS_ENV, "2")
    if setting not in STREAMS_SETTINGS:
        raise ValueError(f"${STREAMS_ENV}={setting!r}: expected one of {STREAMS_SETTINGS}")
    if mx.default_device() != mx.cpu or (os.cpu_count() or 1) < 2:
        return 1
    return int(setting)


_local = threading.local()


def second_stream() -> mx.Stream:
    """The calling thread's second CPU stream (MLX's streams belong to the thread that made
    them, so each thread makes its own, once)."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_stream(mx.cpu)
    return stream


_fused_shifted_exp = mx.compile(_shifted_exp, shapeless=True)
FAST_SOFTMAX = fast_softmax_reason() is None
ATTENTION_STREAMS = attention_streams_setting()


def warm_up() -> None:
    """Build the fast softmax's kernel now, not in a request's first tick: the C++ compiler
    takes ~8 s on a machine's first run (MLX keeps the kernel on disk for later processes, and
    one shapeless kernel serves every shape of as many dimensions: `attend`'s scores are 4-D).
    MLX keeps compiled functions per thread, so a thread that runs the forward calls this too:
    tracing there makes the few scalar constants the trace keeps before any baseline of MLX's
    memory is taken."""
    fast_softmax_reason()  # a bad $FAIRTICK_SOFTMAX is refused, as at import
    attention_streams_setting()  # and a bad $FAIRTICK_ATTENTION_STREAMS
    native.setting()  # and a bad $FAIRTICK_ATTENTION_KERNEL
    native.slice_attention()  # built now (~10 s on a machine's first run), not in a tick
    if FAST_SOFTMAX:
        mx.eval(softmax(mx.zeros((1, 1, 2, 3))))
        if ATTENTION_STREAMS > 1:
            with mx.stream(second_stream()):
                mx.eval(softmax(mx.zeros((1, 1, 2, 3))))


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, in float32 (as MLX's precise softmax computes half-precision
    scores): the fast kernel where it can be built, else MLX's own."""
    if not FAST_SOFTMAX:
        return mx.softmax(scores, axis=-1, precise=True)
    weights, total = _weights(scores)
    return (weights / total).astype(scores.dtype)


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
    queries = queries.reshape(batch, num_kv_heads, group * length, dim)
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}: an array, 'causal' or None")
    kernel = native.slice_attention() if FAST_SOFTMAX and mask == "causal" and 1 < length \
        else None
    # The native kernels scale the queries as they read them, as the ops below do first (one
    # product each, rounded alike): one op fewer to dispatch.
    if kernel is not None and queries.dtype == keys.dtype == values.dtype == mx.float32:
        out = kernel(queries, keys, values, length, scale)
    elif length == 1 and (rows := _rows_kernel(queries, keys, values, cache, mask)) is not None:
        out = rows[0](queries, keys, values, rows[1], scale)
    elif FAST_SOFTMAX and mask == "causal" and 1 < length < num_keys:
        out = _attend_slice(mx.array(scale, queries.dtype) * queries, keys, values, group,
                            length)
    else:
        queries = mx.array(scale, queries.dtype) * queries
        if FAST_SOFTMAX and length == 1:
            # Decode rows: keys @ queries^T reads the long operand as BLAS's rows (the same
            # dot products); a 4-row batch's attention at 1,300-3,000 keys 0.88-0.92x the time.
            scores = (keys @ queries.swapaxes(-1, -2)).swapaxes(-1, -2)
        else:
            scores = queries @ keys.swapaxes(-1, -2)
        if mask is not None:
            scores = _masked(scores.reshape(batch, num_kv_heads, group, length, num_keys),
                             mask, num_kv_heads, group).reshape(
                batch, num_kv_heads, group * length, num_keys)
        if FAST_SOFTMAX:
            weights, total = _weights(scores)
            out = (weights @ values) / total
        else:
            out = mx.softmax(scores, axis=-1, precise=True) @ values
    return out.astype(values.dtype).reshape(batch, num_heads, length, -1)


def rows_kernel_serves(group: int, head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether decode rows of `group` query heads a key head, of `head_dim`, computed in
    `dtype`, attend through the decode rows' kernel (runtime/native.py) here."""
    return FAST_SOFTMAX and group <= 16 and head_dim % 8 == 0 and dtype == mx.float32 and \
        native.rows_attention() is not None


def _rows_kernel(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                 mask: mx.array | str | None) -> tuple[Any, mx.array] | None:
    # The decode rows' kernel and each row's first key, where it computes what the ops would:
    # one token a row, float32, and a mask that is none (every key) or a batch cache's left
    # padding over its whole keys (what mlx-lm's mask for a decode step is).
    if not rows_kernel_serves(queries.shape[2], queries.shape[3], queries.dtype) or not (
            keys.dtype == values.dtype == mx.float32):
        return None
    kernel = native.rows_attention()
    if mask is None:
        return kernel, mx.zeros((queries.shape[0],), mx.int32)
    if isinstance(cache, BatchKVCache) and keys.shape[2] == cache._idx and \
            cache.left_padding.shape == (queries.shape[0],):
        return kernel, cache.left_padding
    return None


def _weights(scores: mx.array) -> tuple[mx.array, mx.array]:
    # exp(scores - max) in float32, and its sum over the keys.
    scores = scores.astype(mx.float32)
    weights = _fused_shifted_exp(scores, mx.max(scores, axis=-1, keepdims=True))
    return weights, mx.sum(weights, axis=-1, keepdims=True)


def _attend_slice(queries: mx.array, keys: mx.array, values: mx.array, group: int,
                  length: int) -> mx.array:
    # A causal slice of `length` queries (rows group-major) after `cached` keys: every query
    # sees every cached key unmasked, and its own slice's keys under the causal triangle. The
    # scores are laid out keys-major, (keys, queries): keys @ queries^T reads the long operand
    # as BLAS's rows, the max and sum reduce over keys down the columns, and the weights enter
    # the values' product transposed; the same dot products and sums as queries @ keys^T, and
    # 0.74-0.87x the time for 8-128 tokens at contexts 1,000-9,000, 0.82-0.95x for 512 (one
    # half-layer, alternated in one process: ADR 0014 revision 3).
    cached = keys.shape[2] - length
    rows_t = queries.swapaxes(-1, -2)
    past = (keys[:, :, :cached] @ rows_t).astype(mx.float32)
    own = (keys[:, :, cached:] @ rows_t).astype(mx.float32)
    own = mx.where(mx.array(_triangle(length, group)), own, mx.array(-float("inf"), own.dtype))
    most = mx.maximum(mx.max(past, axis=-2, keepdims=True), mx.max(own, axis=-2, keepdims=True))
    w_past, w_own = _fused_shifted_exp(past, most), _fused_shifted_exp(own, most)
    total = mx.sum(w_past, axis=-2, keepdims=True) + mx.sum(w_own, axis=-2, keepdims=True)
    out = w_past.swapaxes(-1, -2) @ values[:, :, :cached] + \
        w_own.swapaxes(-1, -2) @ values[:, :, cached:]
    return out / total.swapaxes(-1, -2)


@functools.lru_cache(maxsize=32)
def _triangle(length: int, group: int) -> np.ndarray:
    # Which of a slice's own keys (rows) each of its queries (columns, group-major) sees: kept
    # on the host per shape and handed to MLX as data (no graph, nothing to evaluate, any
    # stream may read it), not rebuilt by six ops in every layer of every tick. Host memory,
    # so MLX holds it only while a tick uses it.
    positions = np.arange(length)
    return np.tile(positions[:, None] <= positions[None], (1, group))


def _masked(scores: mx.array, mask: mx.array | str, num_kv_heads: int,
            group: int) -> mx.array:
    # scores (B, Hkv, group, T, C); the mask as the fallback applies it.
    length, num_keys = scores.shape[-2:]
    if isinstance(mask, str):  # "causal"
        start = max(num_keys - length, 0)
        mask = mx.arange(start, start + length)[:, None] >= mx.arange(num_keys)[None]
    elif mask.ndim >= 3:
        mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mask.reshape(
            *mask.shape[:-3], num_kv_heads, group, *mask.shape[-2:])
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
    return scores + mask.astype(scores.dtype)
