"""runtime/kernels.py against the `mx.fast` ops whose CPU fallbacks they restate: bit for bit
where MLX's compiled kernels round each product and sum on its own (g++ at the default x86-64
target; elsewhere a compiler may fuse a multiply-add, so there to float32 rounding)."""

from __future__ import annotations

import platform

import mlx.core as mx
import mlx.nn as nn
import pytest

from runtime import attention
from runtime.kernels import rms_norm, rotate

EXACT = not attention.FAST_SOFTMAX or platform.machine() in ("x86_64", "AMD64")
DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def same(a: mx.array, b: mx.array) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape
    return mx.array_equal(a, b).item() if EXACT else mx.allclose(
        a.astype(mx.float32), b.astype(mx.float32), rtol=1e-3, atol=1e-5).item()


def normal(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 257])
def test_rms_norm_is_the_fast_ops_own(dtype, tokens):
    norm = nn.RMSNorm(96, eps=1e-6)
    norm.weight = normal((96,), 1).astype(dtype)
    for seed, scale in ((2, 1.0), (3, 40.0), (4, 1e-3)):
        x = normal((tokens, 96), seed, scale).astype(dtype)
        assert same(rms_norm(norm, x), mx.fast.rms_norm(x, norm.weight, norm.eps))


@pytest.mark.parametrize("width", [7, 128, 384, 3584])
def test_the_native_rms_norm_is_the_compiled_forms_own(width, monkeypatch):
    # fairtick's native kernel (one op) against the compiled fallback (four), float32: the same
    # floats in the same order, so bit for bit wherever MLX sums one float at a time.
    from runtime import native
    kernel = native.rms_norm()
    if kernel is None or not attention.FAST_SOFTMAX:
        pytest.skip(f"no native kernels here: {native.reason()}")
    norm = nn.RMSNorm(width, eps=1e-5)
    norm.weight = normal((width,), 21) + 1
    for seed, scale, tokens in ((22, 1.0, 1), (23, 40.0, 33), (24, 1e-3, 5)):
        x = normal((tokens, width), seed, scale)
        native_out = rms_norm(norm, x)
        monkeypatch.setattr(native, "rms_norm", lambda: None)
        compiled = rms_norm(norm, x)
        monkeypatch.setattr(native, "rms_norm", lambda: kernel)
        assert same(native_out, compiled) and same(native_out, norm(x))
    view = normal((width, 6), 25).T  # a transposed view: its rows gathered first
    assert same(rms_norm(norm, view), norm(view))


def test_rms_norm_promotes_as_the_fast_op_does():
    norm = nn.RMSNorm(8)  # float32 weight, half-precision input
    x = normal((3, 8), 5).astype(mx.float16)
    got, want = rms_norm(norm, x), mx.fast.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == mx.float32 and same(got, want)


def test_another_norm_is_called_as_it_is():
    norm = nn.LayerNorm(8)
    x = normal((2, 8), 6)
    assert mx.array_equal(rms_norm(norm, x), norm(x)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_is_the_rope_fallbacks_rotation(dtype):
    x1, x2 = (normal((4, 2, 3, 16), s, 5.0).astype(dtype) for s in (7, 8))
    theta = normal((4, 1, 3, 16), 9, 100.0)
    cos, sin = mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)
    first, second = rotate(x1, x2, cos, sin)
    assert same(first, x1 * cos - x2 * sin)
    assert same(second, x1 * sin + x2 * cos)


def graph_ops(tmp_path, *outputs: mx.array) -> int:
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), *outputs)
    return dot.read_text().count("shape=rectangle")  # one per op (inputs are ellipses)


@pytest.mark.skipif(not attention.FAST_SOFTMAX, reason="MLX's own ops run (no compiled kernels)")
def test_the_kernels_run_fewer_ops_than_the_fallbacks(tmp_path):
    norm, x = nn.RMSNorm(64), normal((4, 64), 10)
    mx.eval(norm.parameters(), x)  # only the ops under test are left to count
    from runtime import native
    ops = 1 if native.rms_norm() is not None else 4  # the native kernel, or the compiled form
    assert graph_ops(tmp_path, rms_norm(norm, x)) == ops < graph_ops(tmp_path, norm(x))
    x1, x2, cos, sin = inputs = [normal((2, 2, 1, 8), s) for s in range(11, 15)]
    mx.eval(inputs)
    assert graph_ops(tmp_path, *rotate(x1, x2, cos, sin)) == 2  # a kernel per output
    assert graph_ops(tmp_path, x1 * cos - x2 * sin, x1 * sin + x2 * cos) == 6
