"""A rope's cosines and sines, computed once and read off a table of positions.

On MLX's CPU, `mx.fast.rope` runs its op-level fallback, which builds a position's sines and
cosines from scratch at every call (29 ops); runtime/fused.py's forward takes them once per
segment (`RopeTable.of`), reads a segment's rows off a table of every position that the rope
computed once (`_positions`, made as long as the model's context by `prepare` when an Executor
is made), and applies them in each layer with the fallback's own remaining ops (`apply`): the
same output, bit for bit (tests/runtime/test_fused.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from runtime import native
from runtime.kernels import rotate

if TYPE_CHECKING:
    from runtime.fused import Segment


@dataclass(frozen=True)
class RopeTable:
    """The cosines and sines `mx.fast.rope`'s CPU fallback computes for a segment's positions,
    for every `nn.RoPE` with the same settings (`key`). They are read off the rope itself: on
    a probe whose rotated pairs are (1, 0), the fallback returns 1*cos - 0*sin = cos and
    1*sin + 0*cos = sin, exactly (a product by 1 or 0 and a sum with 0 round nothing)."""

    key: tuple[int, bool, float, float, mx.Dtype]  # dims, traditional, base, scale, dtype
    cos: mx.array
    sin: mx.array

    @staticmethod
    def of(rope: Any, segment: Segment, dtype: mx.Dtype) -> RopeTable | None:
        """The table of `segment` (its cache's offset, before this step's update) for `rope` on
        arrays of `dtype`; None where the rope is not plain `nn.RoPE` on the CPU (its own call
        then runs). Its rows are read off `_positions`, the rope's table of every position up
        to the segment's last (a slice, or a gather by the rows' offsets: 1-4 ops where the
        rope's fallback is ~25 a segment), except where the cache gives no bound on its
        offsets on the host (no `_idx`): then the rope computes it for the segment alone."""
        if type(rope) is not nn.RoPE or mx.default_device() != mx.cpu:
            return None
        key = _rope_key(rope, dtype)
        rows, length = segment.tokens.shape
        cache = segment.cache[0]
        offset = cache.offset
        if not isinstance(offset, mx.array):
            cos, sin = _positions(rope, key, offset + length)
            return RopeTable(key, cos[offset: offset + length][None, None],
                             sin[offset: offset + length][None, None])
        bound = getattr(cache, "_idx", None)  # mlx-lm's batch cache: every offset <= _idx
        if not isinstance(bound, int):
            batch = rows if offset.size > 1 else 1
            cos, sin = _rope_angles(rope, dtype, (batch, 1, length, rope.dims), offset)
            return RopeTable(key, cos, sin)
        cos, sin = _positions(rope, key, bound + length)
        at = (offset.reshape(-1, 1) + mx.arange(length)).reshape(-1)
        shape = (offset.size, 1, length, rope.dims // 2)
        return RopeTable(key, mx.take(cos, at, axis=0).reshape(shape),
                         mx.take(sin, at, axis=0).reshape(shape))

    def serves(self, rope: Any, dtype: mx.Dtype) -> bool:
        """Whether the table is what `rope` computes for arrays of `dtype`."""
        return type(rope) is nn.RoPE and _rope_key(rope, dtype) == self.key

    def apply(self, x: mx.array) -> mx.array:
        """What the rope returns for `x` (rows, heads, length, head dims): the fallback's ops
        after its sines and cosines (mlx/fast.cpp, `rope`), in the same order."""
        dims, traditional = self.key[0], self.key[1]
        kernel = native.rotate_halves()
        if kernel is not None and not traditional and dims == x.shape[-1] and \
                x.dtype == mx.float32 and self.cos.dtype == mx.float32:
            return kernel(x, self.cos, self.sin)  # one op for the six below, bit for bit
        if traditional:
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        else:
            x1, x2 = x[..., : dims // 2], x[..., dims // 2: dims]
        first, second = rotate(x1, x2, self.cos, self.sin)
        rest = [x[..., dims:]] if dims < x.shape[-1] else []
        if traditional:
            out = mx.concatenate([first[..., None], second[..., None]], axis=-1)
            out = out.reshape(*x.shape[:-1], dims)
            return mx.concatenate([out, *rest], axis=-1) if rest else out
        return mx.concatenate([first, second, *rest], axis=-1)


def _rope_key(rope: Any, dtype: mx.Dtype) -> tuple[int, bool, float, float, mx.Dtype]:
    # What makes a rope's angles on arrays of `dtype`: RopeTable's and `_POSITIONS`' key.
    return rope.dims, rope.traditional, rope.base, rope.scale, dtype


def _rope_angles(rope: Any, dtype: mx.Dtype, shape: tuple[int, int, int, int],
                 offset: int | mx.array) -> tuple[mx.array, mx.array]:
    # The cosines and sines `rope` applies to an array of `shape` (batch, 1, length, dims) at
    # `offset`, read off the rope itself (RopeTable's docstring says how).
    half = rope.dims // 2
    unit = mx.array([1.0, 0.0], dtype)
    if rope.traditional:  # pairs (x[2i], x[2i+1])
        probe = mx.tile(unit, half)
    else:  # pairs (x[i], x[i + dims/2])
        probe = mx.repeat(unit, half)
    out = rope(mx.broadcast_to(probe, shape), offset=offset)
    if rope.traditional:
        return out[..., 0::2], out[..., 1::2]
    return out[..., :half], out[..., half:]


# By RopeTable's key: the cosines and sines (positions, dims / 2) of positions 0, 1, ..., as the
# rope computes them at offset 0. A position's are the same at any offset and in a segment of
# any length (the fallback's angle is the position, an integer exact in float32, times each
# frequency: tests/runtime/test_fused.py checks them bit for bit), so a segment's rows are
# read off it. `prepare` makes them as long as the model's context (at most 131,072
# positions) when an Executor is made (4 MiB for the built-in model's 32,768 positions, 64 MiB
# for a head dimension of 128 at 131,072); one a segment reaches past grows by doubling (at
# least 4,096 positions), by whichever thread's segment reaches past it: stored once
# evaluated, so any thread may read it.
_POSITIONS: dict[tuple[int, bool, float, float, mx.Dtype], tuple[mx.array, mx.array]] = {}
_MIN_POSITIONS = 4096
_PREPARED_POSITIONS = 131072


def prepare(model: Any, context_length: int) -> None:
    """Compute the rope tables of `model` (one that passes `can_fuse`) for its context at once
    (up to `_PREPARED_POSITIONS`), so their memory is held from start-up, not grown while
    requests run; a segment past them grows them (a million-token context's table would be
    ~0.5 GiB at a head dimension of 128, held for the one request that goes that far)."""
    if mx.default_device() != mx.cpu:
        return  # RopeTable serves the CPU only
    inner = model.model
    dtype = inner.embed_tokens(mx.array([0])).dtype  # the activations', as forward_fused's
    for layer in inner.layers:
        rope = layer.self_attn.rope
        if type(rope) is nn.RoPE:
            _positions(rope, _rope_key(rope, dtype), min(context_length, _PREPARED_POSITIONS))


def _positions(rope: Any, key: tuple[int, bool, float, float, mx.Dtype],
               needed: int) -> tuple[mx.array, mx.array]:
    # The rope's table of at least `needed` positions.
    table = _POSITIONS.get(key)
    if table is None or table[0].shape[0] < needed:
        have = 0 if table is None else table[0].shape[0]
        size = max(needed, 2 * have, _MIN_POSITIONS)
        cos, sin = _rope_angles(rope, key[4], (1, 1, size, rope.dims), 0)
        table = (mx.contiguous(cos[0, 0]), mx.contiguous(sin[0, 0]))
        mx.eval(table)  # before it is stored: another thread may read it (runtime/lane.py)
        _POSITIONS[key] = table
    return table
