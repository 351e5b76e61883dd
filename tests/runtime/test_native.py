"""fairtick's native kernels (runtime/native.py): the slice-attention kernel against attention in
float64, and its fallbacks.

The kernel must compute a causal slice's attention against its cache: every query sees every
cached key and its own slice's keys up to its position, for any cache length (none, less than
a key block, block edges), slice length (one 8-wide pass of query rows, several 16-wide ones,
a last one part-filled), key layout (a cache's view into a larger buffer, a last axis that is
not contiguous) and batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runtime import attention, native
from runtime.attention import attend


@pytest.fixture
def kernel():
    found = native.slice_attention()
    if found is None:
        pytest.skip(f"no slice-attention kernel here: {native.reason()}")
    return found


def float64_attention(q: mx.array, k: mx.array, v: mx.array, length: int) -> np.ndarray:
    """Causal attention of the last `length` positions: q (B, H, group * length, D) group-major,
    k and v (B, H, keys, D)."""
    q64, k64, v64 = (np.array(a).astype(np.float64) for a in (q, k, v))
    keys = k64.shape[2]
    scores = q64 @ k64.swapaxes(-1, -2)
    position = np.arange(q64.shape[2]) % length
    visible = np.arange(keys)[None, :] <= (keys - length + position)[:, None]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v64


def inputs(batch: int, heads: int, group: int, length: int, cached: int, seed: int):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, group * length, 32)) * 0.3
    # A cache's keys are a view of the first keys of a larger buffer (mlx-lm's KVCache).
    buffer_k = mx.random.normal((batch, heads, cached + length + 50, 32))
    buffer_v = mx.random.normal((batch, heads, cached + length + 50, 32))
    return q, buffer_k[:, :, :cached + length], buffer_v[:, :, :cached + length]


# (batch, kv heads, group, slice length, cached keys)
SHAPES = [(1, 2, 2, 2, 0), (1, 2, 2, 4, 9000), (1, 1, 2, 5, 63), (1, 2, 2, 8, 64),
          (1, 2, 2, 9, 65), (1, 2, 1, 24, 700), (2, 2, 2, 7, 130), (1, 1, 4, 100, 3),
          (1, 2, 2, 1, 40)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_the_kernel_computes_causal_slice_attention(shape, kernel):
    batch, heads, group, length, cached = shape
    q, k, v = inputs(batch, heads, group, length, cached, seed=sum(shape))
    out = kernel(q, k, v, length)
    assert out.shape == q.shape and out.dtype == mx.float32
    truth = float64_attention(q, k, v, length)
    assert np.allclose(np.array(out), truth, rtol=1e-4, atol=2e-6), \
        np.abs(np.array(out) - truth).max()


@pytest.mark.parametrize("scale", [0.17, 32 ** -0.5, 128 ** -0.5, 1 / 3])
def test_the_kernels_scale_their_queries_as_mlxs_product_does(kernel, rows_kernel, scale):
    # attend hands the kernels the queries unscaled, and the scale: their outputs must be what
    # they compute from queries MLX scaled (the ops' way, and mlx-lm's), bit for bit.
    q, k, v = inputs(2, 2, 2, 6, 200, seed=5)
    scaled = mx.array(scale, mx.float32) * q
    assert mx.array_equal(kernel(q, k, v, 6, scale), kernel(scaled, k, v, 6)).item()
    rows, starts = q[:, :, :2], mx.array([0, 37])  # two decode rows, two heads a key head
    assert mx.array_equal(rows_kernel(rows, k, v, starts, scale),
                          rows_kernel(scaled[:, :, :2], k, v, starts)).item()
    assert not mx.array_equal(kernel(q, k, v, 6, scale), kernel(q, k, v, 6)).item()


def test_keys_whose_last_axis_is_not_contiguous_are_read_right(kernel):
    q, k, v = inputs(1, 2, 2, 6, 200, seed=3)
    k_t = mx.contiguous(k.swapaxes(-1, -2)).swapaxes(-1, -2)  # strides (..., 1, keys)
    v_t = mx.contiguous(v.swapaxes(-1, -2)).swapaxes(-1, -2)
    assert np.allclose(np.array(kernel(q, k_t, v_t, 6)), np.array(kernel(q, k, v, 6)),
                       rtol=0, atol=0)


def test_attend_runs_the_kernel_and_its_ops_alike(kernel, monkeypatch):
    # attend's fast ops (the kernel off) and the kernel: the same attention, to rounding.
    monkeypatch.setattr(attention, "FAST_SOFTMAX", True)
    mx.random.seed(11)
    q = mx.random.normal((1, 4, 12, 32))
    k, v = mx.random.normal((1, 2, 912, 32)), mx.random.normal((1, 2, 912, 32))
    with_kernel = attend(q, k, v, None, 0.17, "causal")
    monkeypatch.setattr(native, "slice_attention", lambda: None)
    with_ops = attend(q, k, v, None, 0.17, "causal")
    assert mx.allclose(with_kernel, with_ops, rtol=1e-4, atol=1e-5).item()


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv("FAIRTICK_ATTENTION_KERNEL", "fast")
    with pytest.raises(ValueError, match="'fast'.*'auto', 'off'"):
        native.setting()


def run_fresh(env: dict[str, str], code: str) -> str:
    # The kernel is loaded once per process: each setting in a process of its own.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


REASON = "import runtime; from runtime import native; print(native.reason())"


def test_off_and_the_exact_softmax_turn_it_off_and_say_so():
    env = {**os.environ, "FAIRTICK_ATTENTION_KERNEL": "off"}
    assert run_fresh(env, REASON) == "$FAIRTICK_ATTENTION_KERNEL=off"
    env = {**os.environ, "FAIRTICK_SOFTMAX": "exact"}
    assert run_fresh(env, REASON).startswith("MLX's softmax runs ($FAIRTICK_SOFTMAX=exact)")


def test_a_directory_named_mlx_before_the_installed_one_changes_nothing(tmp_path):
    # `mlx` is a namespace package: a directory of that name earlier on sys.path (a checkout
    # of MLX's sources) joins it. The kernels still build against the installed MLX (the same
    # build as this process's, from the cache).
    if native.reason() is not None:
        pytest.skip(f"no native kernels here: {native.reason()}")
    (tmp_path / "mlx").mkdir()
    assert run_fresh({**os.environ, "PYTHONPATH": str(tmp_path)}, REASON) == "None"


def test_a_failed_build_is_said_and_attention_still_runs(tmp_path):
    env = {**os.environ, "CXX": "false", "FAIRTICK_CACHE": str(tmp_path)}
    code = ("import runtime, mlx.core as mx; from runtime import native; "
            "from runtime.attention import attend; "
            "out = attend(mx.ones((1, 4, 3, 32)), mx.ones((1, 2, 9, 32)), "
            "mx.ones((1, 2, 9, 32)), None, 0.17, 'causal'); "
            "print(native.reason()); print(mx.allclose(out, mx.ones_like(out)).item())")
    reason, same = run_fresh(env, code).splitlines()
    assert reason.startswith("building native_kernels.cpp failed"), reason
    assert same == "True"
    assert not list(tmp_path.glob("native-kernels-*"))  # nothing half-built left


def test_a_new_build_deletes_the_builds_no_process_loaded_for_30_days(tmp_path):
    day = 24 * 3600
    kept = tmp_path / "native-kernels-new.so"
    stale, recent = tmp_path / "native-kernels-old.so", tmp_path / "native-kernels-other.so"
    # Builds named before the source held more than a slice's attention are pruned alike.
    renamed, renamed_recent = tmp_path / "slice-attention-old.so", \
        tmp_path / "slice-attention-other.so"
    unrelated = tmp_path / "builtin-llama-0123.so"  # not a kernel build
    for path, age_days in ((kept, 0), (stale, 31), (recent, 29), (renamed, 31),
                           (renamed_recent, 29), (unrelated, 400)):
        path.write_bytes(b"")
        os.utime(path, (time.time() - age_days * day,) * 2)
    native._prune_builds(kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "builtin-llama-0123.so", "native-kernels-new.so", "native-kernels-other.so",
        "slice-attention-other.so"]


def test_shapes_that_are_no_slice_are_refused(kernel):
    q, k = mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 5, 8))
    with pytest.raises(ValueError, match="must match queries"):
        kernel(q, k, mx.ones((1, 2, 5, 4)), 2)
    with pytest.raises(ValueError, match="divide the query rows"):
        kernel(q, k, k, 3)


@pytest.fixture
def rows_kernel(kernel):
    return native.rows_attention()


def float64_rows_attention(q: mx.array, k: mx.array, v: mx.array, starts: list[int]):
    """One query token a row: q (B, H, group, D); row b attends keys starts[b] on."""
    q64, k64, v64 = (np.array(a).astype(np.float64) for a in (q, k, v))
    out = np.zeros_like(q64)
    for b, start in enumerate(starts):
        scores = q64[b] @ k64[b, :, start:].swapaxes(-1, -2)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[b] = (weights / weights.sum(axis=-1, keepdims=True)) @ v64[b, :, start:]
    return out


# (rows, kv heads, group, head dim, keys): key counts across the 8-key and 64-key blocks.
ROW_SHAPES = [(1, 2, 2, 32, 1), (4, 2, 2, 32, 600), (3, 2, 4, 64, 65), (2, 1, 16, 8, 130),
              (5, 2, 2, 32, 9000), (2, 2, 1, 128, 71)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=[str(s) for s in ROW_SHAPES])
def test_the_rows_kernel_attends_each_row_from_its_first_key(shape, rows_kernel):
    rows, heads, group, dim, keys = shape
    mx.random.seed(sum(shape))
    q = mx.random.normal((rows, heads, group, dim)) * 0.3
    k = mx.random.normal((rows, heads, keys + 9, dim))[:, :, :keys]  # a cache's view
    v = mx.random.normal((rows, heads, keys + 9, dim))[:, :, :keys]
    starts = [min(17 * b, keys - 1) for b in range(rows)]  # left padding, each row some keys
    out = rows_kernel(q, k, v, mx.array(starts))
    assert out.shape == q.shape
    truth = float64_rows_attention(q, k, v, starts)
    assert np.allclose(np.array(out), truth, rtol=1e-4, atol=2e-6), \
        np.abs(np.array(out) - truth).max()


def test_a_left_padded_decode_batch_attends_through_the_rows_kernel_as_through_the_ops(
        rows_kernel, monkeypatch):
    # A batch cache whose rows hold 3, 40 and 300 tokens (left padding 297, 260, 0), one step.
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache, KVCache

    monkeypatch.setattr(attention, "FAST_SOFTMAX", True)
    mx.random.seed(4)
    caches = []
    for n in (3, 40, 300):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
        caches.append(c)
    batch = BatchKVCache.merge(caches)
    step = mx.zeros((3, 1))
    mask = create_attention_mask(step, batch)
    keys, values = batch.update_and_fetch(mx.random.normal((3, 2, 1, 32)),
                                          mx.random.normal((3, 2, 1, 32)))
    q = mx.random.normal((3, 4, 1, 32))
    starts = []

    def recorded(queries, k, v, first, scale):  # the kernel itself, its rows' first keys noted
        starts.append(first.tolist())
        return rows_kernel(queries, k, v, first, scale)

    monkeypatch.setattr(native, "rows_attention", lambda: recorded)
    with_kernel = attend(q, keys, values, batch, 0.17, mask)
    assert starts == [[297, 260, 0]]
    monkeypatch.setattr(native, "rows_attention", lambda: None)
    with_ops = attend(q, keys, values, batch, 0.17, mask)
    assert mx.allclose(with_kernel, with_ops, rtol=1e-4, atol=1e-5).item()


@pytest.fixture
def swiglu_kernel(kernel):
    return native.swiglu()


def float64_swiglu(gate: mx.array, up: mx.array) -> np.ndarray:
    g, u = (np.array(a).astype(np.float64) for a in (gate, up))
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g)) * u


# Sizes: under one 16-wide vector, a whole number of them, and a part-filled last one.
@pytest.mark.parametrize("shape", [(1, 5), (4, 384), (3, 7, 37)], ids=str)
def test_the_activation_kernel_computes_silu_gate_times_up(shape, swiglu_kernel):
    mx.random.seed(5)
    gate = mx.random.normal(shape) * 6  # far into both tails of the sigmoid
    up = mx.random.normal(shape)
    out = np.array(swiglu_kernel(gate, up))
    assert out.shape == shape
    np.testing.assert_allclose(out, float64_swiglu(gate, up), rtol=2e-6, atol=1e-12)


def test_the_activation_kernel_covers_floats_whole_range(swiglu_kernel):
    # exp(-|g|) across every exponent float32 has, down to where it underflows (below
    # exp(-87.3), ~1e-38, the kernel's is 0: outputs under 1e-35), and the special values as
    # MLX's own silu gives them (-inf * 0 is NaN there too).
    g = np.concatenate([np.linspace(-100.0, 100.0, 4001), -np.logspace(-30, 2, 200),
                        [0.0, -0.0, 1e-30, -87.0, -87.5, -88.5]]).astype(np.float32)
    gate, up = mx.array(g), mx.full(g.shape, 1.5)
    out = np.array(swiglu_kernel(gate, up))
    np.testing.assert_allclose(out, float64_swiglu(gate, up), rtol=2e-6, atol=1e-35)
    special = mx.array([np.inf, -np.inf, np.nan], dtype=mx.float32)
    ones = mx.ones((3,))
    np.testing.assert_array_equal(np.array(swiglu_kernel(special, ones)),
                                  np.array(nn.silu(special) * ones))


def test_the_activation_kernel_reads_views_in_their_order(swiglu_kernel):
    mx.random.seed(6)
    gate, up = mx.random.normal((40, 24)), mx.random.normal((24, 40))
    out = swiglu_kernel(gate.T, up)  # a transposed view: its elements in row order
    np.testing.assert_allclose(np.array(out), float64_swiglu(gate.T, up), rtol=2e-6)
    row = mx.broadcast_to(up[:1, :], (24, 40))  # a broadcast: every row the same
    np.testing.assert_allclose(np.array(swiglu_kernel(up, row)), float64_swiglu(up, row),
                               rtol=2e-6)
    np.testing.assert_allclose(np.array(swiglu_kernel(gate[::2, ::3], up[:20, :8])),
                               float64_swiglu(gate[::2, ::3], up[:20, :8]), rtol=2e-6)


def test_the_activation_kernel_refuses_what_it_cannot_compute(swiglu_kernel):
    with pytest.raises(ValueError, match="one shape"):
        swiglu_kernel(mx.ones((2, 3)), mx.ones((3, 2)))
    with pytest.raises(ValueError, match="float32 only"):
        swiglu_kernel(mx.ones((2, 3), dtype=mx.float16), mx.ones((2, 3), dtype=mx.float16))


@pytest.fixture
def rotate_kernel(kernel):
    return native.rotate_halves()


# (rows, length, offsets): one prompt slice; decode rows each at its own offset.
ROTATIONS = [(1, 7, [37]), (1, 300, [5000]), (4, 1, [900, 12, 4000, 0])]


@pytest.mark.parametrize("rows,length,offsets", ROTATIONS, ids=str)
def test_the_rotation_kernel_is_the_ropes_own_rotation_bit_for_bit(rows, length, offsets,
                                                                   rotate_kernel, monkeypatch):
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from runtime.fused import Segment
    from runtime.rope_table import RopeTable

    rope = nn.RoPE(32, traditional=False, base=10000.0)
    if rows == 1:
        cache = KVCache()
        cache.offset = offsets[0]
    else:
        cache = BatchKVCache([3, 0, 9, 1])
        cache.offset = mx.array(offsets)
    table = RopeTable.of(rope, Segment(mx.zeros((rows, length), mx.int32), [cache], True),
                         mx.float32)
    assert table is not None
    calls = []
    monkeypatch.setattr(native, "rotate_halves",
                        lambda: lambda *a: calls.append(a) or rotate_kernel(*a))
    # The forward's layout: (rows, length, heads, D) projections viewed as (rows, heads, ...).
    x = (mx.random.normal((rows, length, 4, 32), key=mx.random.key(8)) * 3).transpose(0, 2, 1, 3)
    got = table.apply(x)
    assert len(calls) == 1
    assert mx.array_equal(got, rope(x, offset=cache.offset)).item()


def test_the_rotation_kernel_refuses_what_it_cannot_rotate(rotate_kernel):
    x, table = mx.ones((1, 2, 3, 8)), mx.ones((1, 1, 3, 4))
    with pytest.raises(ValueError, match="float32 only"):
        rotate_kernel(x.astype(mx.float16), table, table)
    with pytest.raises(ValueError, match=r"cos and sin \(B or 1, 1, L, D / 2\)"):
        rotate_kernel(x, mx.ones((1, 1, 3, 8)), mx.ones((1, 1, 3, 8)))
