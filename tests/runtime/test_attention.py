"""runtime.attention.attend against MLX's own scaled_dot_product_attention, for every mask kind,
and the fast softmax against a float64 one.

With MLX's softmax, bit for bit where the BLAS computes each row of a product alone (the
reference BLAS), to float32 rounding elsewhere (an optimized BLAS blocks the folded query heads
together); with the fast softmax, to float32 rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime import attention, native
from runtime.attention import attend, fast_softmax_reason, softmax
from tests.runtime.test_fused import blas_rows_independent


def arrays(rows: int, heads: int, kv_heads: int, length: int, keys: int):
    mx.random.seed(rows * 100 + length)
    q = mx.random.normal((rows, heads, length, 32))
    k, v = (mx.random.normal((rows, kv_heads, keys, 32)) for _ in range(2))
    return q, k, v


def masks(rows: int, length: int, keys: int):
    # What mlx-lm hands attention: nothing (one token), "causal" (a prompt slice), a boolean
    # mask per row (a decode batch with left padding), an additive mask.
    keep = mx.arange(keys)[None, None, None, :] >= mx.arange(rows)[:, None, None, None]
    return {"none": None, "causal": "causal", "bool": keep,
            "additive": mx.where(keep, 0.0, -1e9).astype(mx.float32)}


# (rows, heads, kv_heads, length, keys)
SHAPES = [(1, 4, 2, 1, 700), (5, 4, 2, 1, 300), (1, 4, 2, 16, 500), (3, 8, 2, 4, 64),
          (2, 4, 4, 3, 40), (1, 4, 2, 24, 3000), (1, 4, 2, 8, 8)]


@pytest.fixture
def fast_softmax(monkeypatch):
    """The fast softmax on; the test skipped where it cannot be built (no g++)."""
    reason = fast_softmax_reason()
    if reason is not None:
        pytest.skip(f"no fast softmax here: {reason}")
    monkeypatch.setattr(attention, "FAST_SOFTMAX", True)


# mlx-lm makes no causal mask for one token.
@pytest.mark.parametrize(("kind", "shape"), [
    (kind, shape) for kind in ("none", "causal", "bool", "additive") for shape in SHAPES
    if not (kind == "causal" and shape[3] == 1)])
@pytest.mark.parametrize("fast", [False, True, "ops"],
                         ids=["mlx_softmax", "fast_softmax", "fast_softmax_ops"])
def test_attend_computes_what_mlx_does(kind, shape, fast, monkeypatch, request):
    # "ops": the fast softmax in MLX's ops, a slice's attention not in the kernel
    # (runtime/native.py), as where the kernel cannot be built.
    if fast:
        request.getfixturevalue("fast_softmax")
        if fast == "ops":
            monkeypatch.setattr(native, "slice_attention", lambda: None)
    else:
        monkeypatch.setattr(attention, "FAST_SOFTMAX", False)
    rows, heads, kv_heads, length, keys = shape
    q, k, v = arrays(rows, heads, kv_heads, length, keys)
    mask = masks(rows, length, keys)[kind]
    ours = attend(q, k, v, None, 0.17, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    assert ours.shape == theirs.shape == (rows, heads, length, 32)
    if fast or not blas_rows_independent():
        assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-5).item()
    else:
        assert mx.array_equal(ours, theirs).item()


def float64_softmax(scores: mx.array) -> np.ndarray:
    x = np.array(scores).astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def relative_error(weights: mx.array, truth: np.ndarray) -> float:
    big = truth > 1e-9  # weights below are noise to either softmax
    return float(np.max(np.abs(np.array(weights).astype(np.float64) - truth)[big] / truth[big]))


@pytest.mark.parametrize("keys", [1, 7, 300, 2000, 8000])
@pytest.mark.parametrize("spread", [1.0, 8.0])
def test_the_fast_softmax_errs_no_more_than_mlxs_own(keys, spread, fast_softmax):
    mx.random.seed(keys)
    scores = mx.random.normal((3, 2, 4, keys)) * spread
    truth = float64_softmax(scores)
    theirs = relative_error(mx.softmax(scores, axis=-1, precise=True), truth)
    ours = relative_error(softmax(scores), truth)
    # Both are rounding: of the sum over the keys (MLX's), and of six squarings (ours).
    assert ours <= max(3 * theirs, 1e-5), (ours, theirs)


def test_the_fast_softmax_gives_masked_and_underflowing_keys_next_to_nothing(fast_softmax):
    weights = np.array(softmax(mx.array([[0.0, -float("inf"), 1.0, -1e9, -100.0]])))[0]
    expected = float64_softmax(mx.array([[0.0, 1.0]]))[0]
    # exp(-80) of the largest weight at most: below what a float32 sum of weights can register.
    assert (weights[[1, 3, 4]] <= 2e-35 * weights.max()).all()
    assert np.allclose(weights[[0, 2]], expected, rtol=1e-6)


@pytest.mark.parametrize("fast", [False, True], ids=["mlx_softmax", "fast_softmax"])
def test_masked_keys_add_nothing_to_attention(fast, monkeypatch, request):
    if fast:
        request.getfixturevalue("fast_softmax")
    else:
        monkeypatch.setattr(attention, "FAST_SOFTMAX", False)
    q, k, v = arrays(2, 4, 2, 3, 40)
    starts = [10, 25]  # each row's first unmasked key (a left-padded decode batch)
    keep = mx.arange(40)[None, None, None, :] >= mx.array(starts)[:, None, None, None]
    poisoned = mx.where(keep.squeeze(2)[..., None], v, 1e6)  # masked keys hold huge values
    ours = attend(q, k, poisoned, None, 0.17, keep)
    for row, start in enumerate(starts):
        alone = attend(q[row:row + 1], k[row:row + 1, :, start:], v[row:row + 1, :, start:],
                       None, 0.17, None)
        assert mx.allclose(ours[row:row + 1], alone, rtol=1e-5, atol=1e-6).item()


def test_half_precision_scores_are_softmaxed_in_float32(fast_softmax):
    scores = (mx.random.normal((2, 500)) * 4).astype(mx.bfloat16)
    weights = softmax(scores)
    assert weights.dtype == mx.bfloat16
    truth = float64_softmax(scores.astype(mx.float32))
    theirs = relative_error(mx.softmax(scores, axis=-1, precise=True).astype(mx.float32), truth)
    assert relative_error(weights.astype(mx.float32), truth) <= max(1.5 * theirs, 1e-2)


def test_the_softmax_setting_is_checked(monkeypatch):
    monkeypatch.setenv("FAIRTICK_SOFTMAX", "exact")
    assert fast_softmax_reason() == "$FAIRTICK_SOFTMAX=exact"
    monkeypatch.setenv("FAIRTICK_SOFTMAX", "quick")
    with pytest.raises(ValueError, match="'quick'.*'auto', 'exact'"):
        fast_softmax_reason()


def test_an_unknown_mask_name_is_refused():
    q, k, v = arrays(1, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="'sliding'.*'causal'"):
        attend(q, k, v, None, 0.17, "sliding")
