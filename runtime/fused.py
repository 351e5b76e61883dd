"""One forward pass over a ragged batch: a tick's decode rows and prefill slices together.

A tick's work is a list of segments. Each segment is a block of tokens, shape (rows, length),
with its own per-layer KV cache: the decode batch (rows = sequences, length 1, one mlx-lm
`BatchKVCache`) or the slice of one prompt (rows 1, length = slice tokens, its `KVCache`).
For the Llama family (mlx-lm's `llama` module, which also serves mistral, and `qwen2`) the
norms, projections and MLP run once over every token of every segment, concatenated along the
token axis; rope, the cache update and attention run per segment against its own cache, with
the ops and shapes of mlx-lm's own layer. Its output equals the model's own forward bit for bit
where the BLAS computes each row of a product alone (the reference BLAS), and to float32
rounding where it blocks rows together (OpenBLAS). Any other architecture runs each segment
through the model's own forward (`forward_apart`).

On MLX's CPU, `mx.fast.rope` runs its op-level fallback, which builds a position's sines and
cosines from scratch at every call (29 ops): two calls in each of a step's layers were ~40% of a
decode step's ops, and a short-context step's time is mostly its ops' count. A segment's
positions are the same in every layer, so `forward_fused` takes the fallback's sines and
cosines once per segment (`RopeTable`, runtime/rope_table.py) and each layer applies them with
the fallback's own remaining ops (the rotation and the norms as compiled kernels:
runtime/kernels.py): the same output, bit for bit. And a position's sines and cosines are
the same in every tick, so a segment reads its rows off a table of positions that the rope
computed once (`_positions`), in 1-4 ops instead of the fallback's ~25: a 4-row decode step
0.95-0.99x, with a 16-token slice 0.89-0.93x, 16 rows unchanged (alternated in-process).

MLX's CPU worker runs a graph only once it is handed over, and building a step's graph takes
the engine thread ~1 ms; so each layer's output is handed to the worker (`mx.async_eval`) as
soon as it is built, and the worker computes it while the engine builds the next layer. A tick
with a prefill slice, which cannot queue its next step ahead, ran ~0.9 ms (1 slice token) to
~1.2 ms (8) shorter in-process, next to 4 decode rows at context 4,096, and a decode-only step
~0.5 ms (alternated A/B, 5 pairs each).

Where the native kernels are had (runtime/native.py), a float32 rope's rotation of the pairs
(x[i], x[i + D/2]) is one op of theirs instead of the fallback's remaining six (two slices, the
rotation, a concatenation, the broadcasts), bit for bit.

The MLP's activation (silu(gate) * up) runs through fairtick's native kernel where it can be
had (runtime/native.py `swiglu`: MLX's CPU build computes each exponential alone, 0.45 ms of a
layer's ~0.6 ms of MLP for a 64-token slice), to float32 rounding of mlx-lm's.

A tick's segments attend independently, and so does each key head's group of query heads;
MLX runs each CPU stream on a thread of its own, and a tick with a slice cannot queue its next
step, so its engine thread waits while one core works. So on the CPU (`attention_streams`)
every prefill slice of more than one token attends with its key heads split in two halves, one
on each of two streams, and the decode rows go to the stream with less work (heaviest first):
the same ops on the same arrays, so bit-equal to one stream. Large blocks gain most (each
half's score block stays in the cache), but small slices gain too: 4 decode rows and a slice
at context 9,000 took 0.82x the one-stream time with 8 tokens, 0.63x with 64 (alternated
in-process; docs/benchmark_results/2026-12-01-admission.md, tenth session). A whole
`Executor.run` tick of 4 decode rows and a slice, all at context 6,000: 4 tokens 20.3 ms,
32 tokens 33.5 ms, against 22.0 and 44.1 ms on one stream (medians of 9:
scripts/bench_fused_tick.py --executor --rows 4 --slices 4,32 --executor-context 6000
--reps 9, with each setting). A 10,000-token prompt alone on an idle server reaches its first
token in 4.8-4.9 s against 7.8-9.9 s on one stream, alternated (4.1-7.1 s over all its runs,
7.9-11.3 s before the split: scripts/bench_admission_matrix.py; docs/benchmark_results/
2026-12-01-admission.md, ninth session).
$FAIRTICK_ATTENTION_STREAMS=1 keeps every segment on one stream.

A thread whose forwards run beside another thread's (a prompt prefilled while the streams
decode) wraps them in `layer_by_layer()`: each layer is evaluated before the next is built,
not handed over. MLX counts its queued tasks across all threads (at most 10: `MAX_ACTIVE_TASKS`
in its transforms.cpp) and a thread that dispatches past that waits for any task to end, so a
prompt's forward with its layers queued held the other thread's decode steps behind the
prompt's long attention tasks: 4 streams stepping beside a 10,000-token prompt prefilled in
256-token chunks on another thread had gaps p95 / p99 8.16x / 9.86x their quiet p95 with the
layers queued, 3.51x / 4.05x layer by layer (medians of 6 rounds, in-process:
scripts/bench_prefill_lane.py --rounds 6 --arms lane:256:4,queued:256:4 and others).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache

from runtime import attention, native
from runtime.attention import attend
from runtime.kernels import rms_norm
from runtime.rope_table import RopeTable
from runtime.row_groups import split_rows

# The attention and MLP classes whose __call__ `forward_fused` re-states, read line by line.
_FUSABLE_ATTENTION = (llama.Attention, qwen2.Attention)
_FUSABLE_MLP = (llama.MLP, qwen2.MLP)
_FUSABLE_BLOCK = (llama.TransformerBlock, qwen2.TransformerBlock)


@dataclass(frozen=True)
class Segment:
    """A block of tokens (shape (rows, length)) and its per-layer cache. With `logits`, the
    forward returns the logits of its last position in every row; with `all_logits` too, of
    every position (a prompt whose tokens' log-probabilities are asked for)."""

    tokens: mx.array
    cache: list[Any]
    logits: bool
    all_logits: bool = False

    @property
    def num_tokens(self) -> int:
        return self.tokens.size


def can_fuse(model: Any) -> bool:
    """Whether `forward_fused` computes exactly what `model`'s own forward does."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not all(type(layer) in _FUSABLE_BLOCK for layer in layers):
        return False
    if getattr(inner, "pipeline_size", 1) != 1:  # qwen2 split across processes
        return False
    return all(
        type(layer.self_attn) in _FUSABLE_ATTENTION and type(layer.mlp) in _FUSABLE_MLP
        and not getattr(layer, "use_sliding", False)  # a sliding window needs another cache
        for layer in layers
    )


def forward_fused(model: Any, segments: Sequence[Segment]) -> mx.array | None:
    """Logits (rows wanted, vocab) of every segment with `logits` (every position of one with
    `all_logits`), in segment order; None when no segment wants any. Updates every segment's
    cache. `model` must pass `can_fuse`."""
    inner = model.model
    h = inner.embed_tokens(mx.concatenate([s.tokens.reshape(-1) for s in segments]))
    # Masks as the model makes them: from each segment's shape and cache, before any update.
    masks = [create_attention_mask(s.tokens, s.cache[0]) for s in segments]
    # The decode rows' kernel attends each row from its own first key: no groups to make.
    first = inner.layers[0].self_attn
    kernel = attention.rows_kernel_serves(first.n_heads // first.n_kv_heads,
                                          first.q_proj.weight.shape[0] // first.n_heads, h.dtype)
    groups = [None if kernel else _row_groups(s) for s in segments]
    tables: list[RopeTable | None] = []
    wanted = _wanted_rows(segments)
    last = len(inner.layers) - 1
    early = mx.default_device() == mx.cpu
    places = attention_streams(segments)
    # Where each segment's tokens end among all (the last's end left out): one split of a
    # projection into every segment's part, not a slice for each.
    cuts = list(accumulate(s.num_tokens for s in segments))[:-1]
    for i, layer in enumerate(inner.layers):
        x = rms_norm(layer.input_layernorm, h)
        attn = layer.self_attn
        queries, keys, values = (_parts(_linear(proj, x), cuts)
                                 for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if i == 0:  # every layer's positions are the first's
            tables = [RopeTable.of(attn.rope, s, keys[0].dtype) for s in segments]
        outputs = []
        for k, (segment, mask, rows, table, place) in enumerate(
                zip(segments, masks, groups, tables, places, strict=True)):
            # The last layer's output matters only at the rows whose logits are wanted.
            need = i < last or segment.logits
            with mx.stream(place[0]):
                out = _attend(attn, segment, i, mask, queries[k] if need else None,
                              keys[k], values[k], rows,
                              table if table is not None and
                              table.serves(attn.rope, keys[k].dtype) else None, place[1:])
            if out is not None:
                outputs.append(out)
        if i == last:
            if wanted is None:
                return None
            h, att = h[wanted[0]], _concat(outputs)[wanted[1]]
        else:
            att = _concat(outputs)
        h = h + _linear(attn.o_proj, att)
        h = h + _mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, h))
        if early and i < last:
            if getattr(_local, "layer_by_layer", False):
                mx.eval(h)
            else:
                mx.async_eval(h)  # the worker starts on this layer while the next is built
    return _lm_head(model, rms_norm(inner.norm, h))


_local = threading.local()


@contextmanager
def layer_by_layer() -> Iterator[None]:
    """Within it, this thread's `forward_fused` evaluates each layer before it builds the next,
    so it never holds more than a layer's tasks in MLX's queue (see the module's docstring)."""
    before = getattr(_local, "layer_by_layer", False)
    _local.layer_by_layer = True
    try:
        yield
    finally:
        _local.layer_by_layer = before


def attention_streams(segments: Sequence[Segment]) -> list[tuple[mx.Stream, ...]]:
    """The streams each segment's attention runs on (its rope and cache update on the first).
    With two CPU streams (runtime.attention.ATTENTION_STREAMS), a prefill slice (more than one
    token a row) splits its heads over both, half its work on each, and the other segments go
    heaviest first, each to the stream with less attention work so far (a segment's work: its
    queries times the keys each attends, about); otherwise all on the default stream."""
    default = mx.default_stream(mx.default_device())
    if attention.ATTENTION_STREAMS < 2:
        return [(default,)] * len(segments)
    streams, load = [default, attention.second_stream()], [0, 0]
    work = [s.num_tokens * (s.cache[0].size() + s.tokens.shape[1]) for s in segments]
    places: list[tuple[mx.Stream, ...]] = [(default,)] * len(segments)
    for k in sorted(range(len(segments)), key=lambda k: -work[k]):
        if segments[k].tokens.shape[1] > 1:  # half its work on each: the balance stays
            places[k] = (default, streams[1])
            continue
        lighter = 0 if load[0] <= load[1] else 1
        places[k], load[lighter] = (streams[lighter],), load[lighter] + work[k]
    return places


def forward_apart(model: Any, segments: Sequence[Segment]) -> mx.array | None:
    """What `forward_fused` returns, through the model's own forward once per segment."""
    logits = []
    for segment in segments:
        out = model(segment.tokens, cache=segment.cache)
        if segment.all_logits:
            logits.append(out.reshape(-1, out.shape[-1]))
        elif segment.logits:
            logits.append(out[:, -1, :])
    return _concat(logits) if logits else None


def _attend(attn: Any, segment: Segment, layer: int, mask: Any, queries: mx.array | None,
            keys: mx.array, values: mx.array, groups: RowGroups | None,
            table: RopeTable | None, more: tuple[mx.Stream, ...]) -> mx.array | None:
    # mlx-lm's Attention.__call__ for one segment (rows, length), after the projections, on
    # the current stream; with a stream in `more`, the second half of its heads there.
    rows, length = segment.tokens.shape
    cache = segment.cache[layer]
    keys, values = _heads(keys, rows, length, attn.n_kv_heads), \
        _heads(values, rows, length, attn.n_kv_heads)
    offset = cache.offset
    keys = table.apply(keys) if table is not None else attn.rope(keys, offset=offset)
    keys, values = cache.update_and_fetch(keys, values)
    if queries is None:
        return None
    queries = _heads(queries, rows, length, attn.n_heads)
    queries = table.apply(queries) if table is not None else attn.rope(queries, offset=offset)
    if more and attn.n_kv_heads > 1:
        # Each query head attends its own key head's keys alone: two halves of the heads are
        # the same products and softmaxes as the whole, bit for bit.
        kv_half = attn.n_kv_heads // 2
        q_half = kv_half * (attn.n_heads // attn.n_kv_heads)
        first = attend(queries[:, :q_half], keys[:, :kv_half], values[:, :kv_half], cache,
                       attn.scale, mask)
        with mx.stream(more[0]):
            second = attend(queries[:, q_half:], keys[:, kv_half:], values[:, kv_half:],
                            cache, attn.scale, mask)
        out = mx.concatenate([first, second], axis=1)
    elif groups is None:
        out = attend(queries, keys, values, cache, attn.scale, mask)
    else:
        out = _attend_grouped(queries, keys, values, cache, attn.scale, mask, groups)
    if length == 1:  # (rows, heads, 1, dims) is already in the order of (rows, 1, heads, dims)
        return out.reshape(rows, -1)
    return out.transpose(0, 2, 1, 3).reshape(rows * length, -1)


def _heads(x: mx.array, rows: int, length: int, heads: int) -> mx.array:
    # A segment's projection (rows * length, heads * dims) as (rows, heads, length, dims), as
    # mlx-lm's Attention lays it out (a reshape and a transpose). With one token a row (decode
    # rows) the transpose moves nothing, so a reshape alone: the same elements in the same
    # order, one op fewer.
    if length == 1:
        return x.reshape(rows, heads, 1, -1)
    return x.reshape(rows, length, heads, -1).transpose(0, 2, 1, 3)


@dataclass(frozen=True)
class RowGroups:
    """Decode rows attended group by group: each group's rows (`rows[g]`) against only the
    last `keys[g]` positions of the padded batch cache, which hold all their unmasked keys;
    `order` puts the concatenated outputs back in row order."""

    rows: tuple[mx.array, ...]
    keys: tuple[int, ...]
    padded: tuple[bool, ...]  # whether some row of the group has fewer keys than `keys`
    order: mx.array


def _row_groups(segment: Segment) -> RowGroups | None:
    # The decode rows in groups by runtime/row_groups.py; None: one group (the padded form).
    rows, length = segment.tokens.shape
    cache = segment.cache[0]
    if rows < 2 or length != 1 or not isinstance(cache, BatchKVCache):
        return None
    total = cache._idx + 1  # keys after this step's update
    lengths = [total - pad for pad in cache.left_padding.tolist()]
    groups = split_rows(lengths)
    if groups is None:
        return None
    flat = [r for g in groups for r in g]
    inverse = sorted(range(rows), key=flat.__getitem__)
    keys = [max(lengths[r] for r in g) for g in groups]
    padded = [any(lengths[r] < n for r in g) for g, n in zip(groups, keys, strict=True)]
    return RowGroups(tuple(mx.array(g) for g in groups), tuple(keys), tuple(padded),
                     mx.array(inverse))


def _attend_grouped(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                    scale: float, mask: Any, groups: RowGroups) -> mx.array:
    outs = []
    for rows, num_keys, padded in zip(groups.rows, groups.keys, groups.padded, strict=True):
        # Window first, then the rows: a gather over the whole padded length is ~10x slower.
        def pick(a: mx.array, n: int = num_keys, rows: mx.array = rows) -> mx.array:
            return mx.take(a[..., a.shape[-2] - n:, :], rows, axis=0)
        window_mask = mx.take(mask[..., mask.shape[-1] - num_keys:], rows, axis=0) \
            if padded else None  # every key in the window is every row's own: no mask
        outs.append(attend(mx.take(queries, rows, axis=0), pick(keys), pick(values), cache,
                           scale, window_mask))
    return mx.take(mx.concatenate(outs), groups.order, axis=0)


def _wanted_rows(segments: Sequence[Segment]) -> tuple[mx.array, mx.array] | None:
    # The last position of each row of each segment with `logits`: its index among all tokens,
    # and among the last layer's attention outputs (which skip segments without `logits`).
    everywhere, among_kept, start, kept = [], [], 0, 0
    for s in segments:
        num_rows, length = s.tokens.shape
        if s.logits:
            ends = list(range(s.num_tokens)) if s.all_logits else \
                [r * length + length - 1 for r in range(num_rows)]
            everywhere += [start + e for e in ends]
            among_kept += [kept + e for e in ends]
            kept += s.num_tokens
        start += s.num_tokens
    return (mx.array(everywhere), mx.array(among_kept)) if everywhere else None


def _mlp(mlp: Any, x: mx.array) -> mx.array:
    # mlx-lm's llama and qwen2 MLP, down_proj(swiglu(gate_proj(x), up_proj(x))), its
    # activation through the native kernel where it serves (float32 on the CPU: runtime/
    # native.py); MLX's CPU build takes each exponential alone, which made the activation
    # ~0.45 ms of a layer's ~0.6 ms of MLP for a 64-token slice.
    kernel = native.swiglu()
    if kernel is None:
        return mlp(x)
    gate, up = _linear(mlp.gate_proj, x), _linear(mlp.up_proj, x)
    if gate.dtype != mx.float32 or up.dtype != mx.float32:
        return _linear(mlp.down_proj, swiglu(gate, up))
    return _linear(mlp.down_proj, kernel(gate, up))


def _linear(linear: Any, x: mx.array) -> mx.array:
    # What `linear(x)` computes. For a plain `nn.Linear`, x @ weight.T (plus the bias) with the
    # weight's transposed view taken once and held on the module, not as an op of every call:
    # the same product of the same operands (BLAS reads the view as Linear's own), 7 ops fewer
    # a layer to dispatch. The view is taken again when the module's weight is replaced.
    if type(linear) is not nn.Linear:
        return linear(x)
    weight = linear["weight"]
    held = linear.__dict__.get("_fairtick_weight_t")
    if held is None or held[0] is not weight:
        held = (weight, weight.T)
        mx.eval(held[1])
        object.__setattr__(linear, "_fairtick_weight_t", held)  # not a parameter
    if "bias" in linear:
        return mx.addmm(linear["bias"], x, held[1])
    return x @ held[1]


def _parts(x: mx.array, cuts: list[int]) -> list[mx.array]:
    # `x`'s rows split at `cuts`: one op for all the parts (none for one part).
    return mx.split(x, cuts, axis=0) if cuts else [x]


def _concat(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def _lm_head(model: Any, h: mx.array) -> mx.array:
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return _linear(model.lm_head, h)
