"""runtime.attention.attend against MLX's own scaled_dot_product_attention, for every mask kind.

Bit for bit where the BLAS computes each row of a product alone (the reference BLAS), to
float32 rounding elsewhere (an optimized BLAS blocks the folded query heads together).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from runtime.attention import attend
from tests.runtime.test_fused import same


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


SHAPES = [(1, 4, 2, 1, 700), (5, 4, 2, 1, 300), (1, 4, 2, 16, 500), (3, 8, 2, 4, 64),
          (2, 4, 4, 3, 40)]  # (rows, heads, kv_heads, length, keys)


# mlx-lm makes no causal mask for one token.
@pytest.mark.parametrize(("kind", "shape"), [
    (kind, shape) for kind in ("none", "causal", "bool", "additive") for shape in SHAPES
    if not (kind == "causal" and shape[3] == 1)])
def test_attend_computes_what_mlx_does(kind, shape):
    rows, heads, kv_heads, length, keys = shape
    q, k, v = arrays(rows, heads, kv_heads, length, keys)
    mask = masks(rows, length, keys)[kind]
    ours = attend(q, k, v, None, 0.17, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    assert ours.shape == theirs.shape == (rows, heads, length, 32)
    assert same(ours, theirs)


def test_an_unknown_mask_name_is_refused():
    q, k, v = arrays(1, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="'sliding'.*'causal'"):
        attend(q, k, v, None, 0.17, "sliding")
