"""Two of MLX's `mx.fast` ops as its CPU build computes them, in fewer ops.

On the CPU, `mx.fast.rms_norm` and `mx.fast.rope` run op-level fallbacks (mlx/fast.cpp): an
RMSNorm is 11 ops, a rope 29. A decode step of a small model at short context costs mostly
its ops' count (each is built on the engine thread and run by MLX's worker for a fixed few
microseconds), so runtime/fused.py runs fewer:

- `rms_norm`: the fallback's ops under `mx.compile`, which fuses its elementwise tail (scale
  by the mean, add eps, rsqrt, two products) into one kernel: 4 ops; in float32, where
  fairtick's native kernels are had (runtime/native.py), 1 op that computes the same floats in
  the same order (the squares summed one at a time from 0, as MLX's CPU reduction sums them
  on x86-64), bit for bit (tests/runtime/test_kernels.py): 27 of a 4-row decode step's 150 ops.
- `rotate`: the rotation a rope applies once it has its cosines and sines (rope_table.py's
  `RopeTable` reads those off the rope once per forward): the fallback's four products and two
  sums as one kernel per output (2 ops for 6, and their broadcasts).

The kernels compute the fallback's float32 operations in its order, each rounded on its own:
MLX builds them with `g++ -O3` for the default x86-64 target, which has no fused multiply-add
to merge a product and a sum into one rounding, so the output is the fallback's bit for bit
there (tests/runtime/test_kernels.py checks it). They are on where the fast softmax is
(runtime/attention.py: the CPU, a C++ compiler, $FAIRTICK_SOFTMAX not `exact`); otherwise
these are MLX's own ops.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runtime import attention, native


def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    # mlx/fast.cpp, rms_norm's fallback, op for op.
    x = x.astype(mx.float32)
    x = x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)
    return x.astype(weight.dtype) * weight


def _rotate(x1: mx.array, x2: mx.array, cos: mx.array,
            sin: mx.array) -> tuple[mx.array, mx.array]:
    # mlx/fast.cpp, rope's fallback, `apply_rope` (forward).
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


_compiled_rms_norm = mx.compile(_rms_norm, shapeless=True)
_compiled_rotate = mx.compile(_rotate, shapeless=True)


@cache
def _eps(eps: float) -> mx.array:
    return mx.array(eps, mx.float32)


def rms_norm(norm: Any, x: mx.array) -> mx.array:
    """`norm(x)` for an `nn.RMSNorm` (any other module is called as it is)."""
    if not attention.FAST_SOFTMAX or type(norm) is not nn.RMSNorm:
        return norm(x)
    weight = norm.weight
    kernel = native.rms_norm()
    if kernel is not None and x.dtype == weight.dtype == mx.float32:
        return kernel(x, weight, norm.eps)  # one op for the compiled form's four, bit for bit
    out_type = mx.result_type(x, weight)
    return _compiled_rms_norm(x, weight.astype(out_type), _eps(norm.eps))


def rotate(x1: mx.array, x2: mx.array, cos: mx.array,
           sin: mx.array) -> tuple[mx.array, mx.array]:
    """(x1 cos - x2 sin, x1 sin + x2 cos), as the rope fallback computes them."""
    if not attention.FAST_SOFTMAX:
        return _rotate(x1, x2, cos, sin)
    return _compiled_rotate(x1, x2, cos, sin)


def warm_up() -> None:
    """runtime.attention's warm-up, and these kernels built and traced on this thread (MLX keeps
    compiled functions per thread; the C++ compiler builds each kernel once per machine)."""
    attention.warm_up()
    if attention.FAST_SOFTMAX:
        x = mx.ones((1, 2))
        mx.eval(rms_norm(nn.RMSNorm(2), x), rotate(*(mx.ones((1, 1, 1, 2)),) * 4))
        if attention.ATTENTION_STREAMS > 1:  # a segment's rope rotation may run there
            with mx.stream(attention.second_stream()):
                mx.eval(rotate(*(mx.ones((1, 1, 1, 2)),) * 4))
