"""The fused forward against the model's own forward, array for array.

Bit for bit where the BLAS computes each row of a matrix product on its own (the reference
BLAS that MLX's Linux wheel links does); an optimized BLAS blocks rows together, so a row's
last bits depend on how many rows share the product, and there the arrays must agree to
float32 rounding (the executor's greedy-token tests stay exact under both). The same with
fairtick's fast softmax (runtime/attention.py), whose last bits differ from MLX's.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from runtime import native
from runtime.attention import FAST_SOFTMAX
from runtime.blas import load_blas
from runtime.fused import Segment, can_fuse, forward_apart, forward_fused
from runtime.model import BUILTIN_CONFIG
from tests.runtime.test_kernels import EXACT as ROTATION_EXACT


def blas_rows_independent() -> bool:
    """Whether MLX's products run on the reference BLAS, which computes each row of a product
    on its own. An optimized one may block rows for some shapes and not others (OpenBLAS on one
    machine kept rows apart in a 64 x 128 x 384 product and not in attention's), so no probe of
    one shape can stand for all."""
    return not load_blas().optimized


EXACT = blas_rows_independent() and not FAST_SOFTMAX


def same(a: mx.array, b: mx.array) -> bool:
    return mx.array_equal(a, b).item() if EXACT else mx.allclose(a, b, rtol=1e-4,
                                                                  atol=1e-5).item()


def random_model(module, **config):
    mx.random.seed(5)
    model = module.Model(module.ModelArgs.from_dict({**BUILTIN_CONFIG, **config}))
    mx.eval(model.parameters())
    return model


def filled_cache(model, num_tokens: int, rng: random.Random) -> list:
    cache = make_prompt_cache(model)
    if num_tokens:
        model(mx.array([rng.randrange(258) for _ in range(num_tokens)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def make_segments(model, seed: int, rows: list[int], slices: list[tuple[int, int, bool]]):
    """Decode rows at the given contexts (one BatchKVCache) and (tokens, context, logits)
    slices, each in its own cache; the same seed gives the same arrays."""
    rng = random.Random(seed)
    segments = []
    if rows:
        caches = [filled_cache(model, n, rng) for n in rows]
        batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
        tokens = mx.array([rng.randrange(258) for _ in rows])[:, None]
        segments.append(Segment(tokens, batch, logits=True))
    for num_tokens, context, logits in slices:
        cache = filled_cache(model, context, rng)
        tokens = mx.array([rng.randrange(258) for _ in range(num_tokens)])[None]
        segments.append(Segment(tokens, cache, logits=logits))
    return segments


MIXES = {
    "decode rows only": ([5, 40, 300], []),
    "one slice, no logits": ([], [(16, 0, False)]),
    "slices only": ([], [(16, 0, True), (7, 250, True)]),
    "rows and slices, some ending their prompt": ([3, 17, 260], [(16, 0, True), (33, 20, False),
                                                                 (1, 9, True), (64, 200, False)]),
    "rows and slices that want no logits": ([12], [(5, 3, False), (9, 0, False)]),
    # The longest row attends apart from the rest, which attend only their own window.
    "a row far longer than the rest": ([5, 9, 3, 700, 12], [(6, 40, True)]),
}


@pytest.mark.parametrize("module", [llama, qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("mix", MIXES)
def test_fused_forward_equals_the_models_own_forward(module, mix):
    model = random_model(module, model_type=module.__name__.rsplit(".", 1)[1])
    rows, slices = MIXES[mix]
    fused = make_segments(model, 1, rows, slices)
    apart = make_segments(model, 1, rows, slices)
    got, want = forward_fused(model, fused), forward_apart(model, apart)
    if want is None:
        assert got is None
    else:
        assert got is not None and got.shape == want.shape
        assert same(got, want)
    for mine, theirs in zip(fused, apart, strict=True):
        for a, b in zip(mine.cache, theirs.cache, strict=True):
            assert a.offset.tolist() == b.offset.tolist() if isinstance(a, BatchKVCache) \
                else a.offset == b.offset
            for x, y in zip(a.state[:2], b.state[:2], strict=True):
                assert same(x, y)


def test_the_mlps_activation_runs_through_the_native_kernel_over_every_token_at_once(
        monkeypatch):
    kernel = native.swiglu()
    if kernel is None:
        pytest.skip(f"no native kernels here: {native.reason()}")
    model = random_model(llama, model_type="llama")
    rows, slices = MIXES["rows and slices, some ending their prompt"]
    shapes = []

    def recorded(gate, up):
        shapes.append(gate.shape)
        return kernel(gate, up)

    monkeypatch.setattr(native, "swiglu", lambda: recorded)
    with_kernel = forward_fused(model, make_segments(model, 2, rows, slices))
    # 3 rows and 114 slice tokens in each layer; the last layer's MLP only at the 5 positions
    # whose logits are wanted (the rows and two slices' last tokens).
    assert shapes == [(117, 384)] * 3 + [(5, 384)]
    monkeypatch.setattr(native, "swiglu", lambda: None)
    with_ops = forward_fused(model, make_segments(model, 2, rows, slices))
    assert mx.allclose(with_kernel, with_ops, rtol=1e-4, atol=1e-5).item()


def test_a_half_precision_mlp_keeps_mlx_lms_activation(monkeypatch):
    kernel = native.swiglu()
    if kernel is None:
        pytest.skip(f"no native kernels here: {native.reason()}")
    model = random_model(llama, model_type="llama")
    model.set_dtype(mx.float16)
    calls = []
    monkeypatch.setattr(native, "swiglu", lambda: lambda g, u: calls.append(g) or kernel(g, u))
    rows, slices = MIXES["rows and slices, some ending their prompt"]
    got = forward_fused(model, make_segments(model, 3, rows, slices))
    want = forward_apart(model, make_segments(model, 3, rows, slices))
    assert not calls  # the kernel takes float32 only
    assert got.dtype == mx.float16
    assert mx.allclose(got, want, rtol=1e-2, atol=1e-2).item()


def test_only_architectures_whose_layers_it_restates_are_fused():
    assert can_fuse(random_model(llama, model_type="llama"))
    assert can_fuse(random_model(qwen2, model_type="qwen2"))
    assert not can_fuse(random_model(qwen3, model_type="qwen3", rope_theta=1e6))  # q/k norms
    sliding = random_model(llama, model_type="llama", sliding_window=64,
                           layer_types=["sliding_attention", "full_attention"] * 2)
    assert not can_fuse(sliding)


def test_a_row_far_longer_than_the_rest_attends_apart_and_similar_rows_stay_together():
    from runtime.fused import _row_groups
    model = random_model(llama, model_type="llama")
    far, = make_segments(model, 2, [5, 9, 3, 700, 12], [])
    groups = _row_groups(far)
    assert groups is not None
    assert [g.tolist() for g in groups.rows] == [[3], [4, 1, 0, 2]]
    assert groups.keys == (701, 13) and groups.padded == (False, True)
    near, = make_segments(model, 2, [300, 420, 380, 700], [])
    assert _row_groups(near) is None


ROPES = {
    "llama default": dict(dims=32, traditional=False, base=10000.0),
    "traditional pairs": dict(dims=32, traditional=True, base=10000.0),
    "linear scaling": dict(dims=32, traditional=False, base=500000.0, scale=0.25),
    "partial (dims < head dims)": dict(dims=16, traditional=False, base=10000.0),
    "partial, traditional": dict(dims=16, traditional=True, base=10000.0),
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("offset", ["one row at 37", "rows at their own offsets",
                                    "one row past the first table"])
def test_a_rope_table_rotates_exactly_as_the_rope_itself(rope, dtype, offset, monkeypatch):
    # Whatever the BLAS or softmax: both are elementwise products and sums. The angles come
    # off a table of positions (held across forwards, grown when a segment reaches past it).
    from runtime import rope_table
    from runtime.rope_table import RopeTable
    monkeypatch.setattr(rope_table, "_POSITIONS", {})
    module = nn.RoPE(**ROPES[rope])
    rows, length = (4, 1) if offset == "rows at their own offsets" else (1, 5)
    cache = KVCache()
    cache.offset = 37 if offset == "one row at 37" else rope_table._MIN_POSITIONS * 2 + 3
    if rows > 1:
        # Left padding, as after 4,000 steps of a batch: offsets differ row by row.
        cache = BatchKVCache([3100, 3988, 0, 4000])
        cache.offset, cache._idx = mx.array([900, 12, 4000, 0]), 4000
    if offset == "one row past the first table":  # a table held already, which grows
        RopeTable.of(module, Segment(mx.zeros((1, 1), mx.int32), [KVCache()], True), dtype)
        least = rope_table._MIN_POSITIONS
        assert [t[0].shape[0] for t in rope_table._POSITIONS.values()] == [least]
    segment = Segment(mx.zeros((rows, length), mx.int32), [cache], logits=True)
    table = RopeTable.of(module, segment, dtype)
    assert table is not None and table.serves(module, dtype)
    x = (mx.random.normal((rows, 4, length, 32), key=mx.random.key(3)) * 3).astype(dtype)
    got, want = table.apply(x), module(x, offset=cache.offset)
    assert got.dtype == want.dtype and got.shape == want.shape
    # Bit for bit, unless the compiled rotation may fuse a multiply-add (not on x86-64).
    assert mx.array_equal(got, want).item() if ROTATION_EXACT else mx.allclose(
        got.astype(mx.float32), want.astype(mx.float32), rtol=1e-3, atol=1e-5).item()
    if offset == "one row past the first table":
        grown = 2 * rope_table._MIN_POSITIONS + 8
        assert [t[0].shape[0] for t in rope_table._POSITIONS.values()] == [grown]
    # The same rope on another dtype, or another rope, is not served by this table.
    assert not table.serves(module, mx.float32 if dtype != mx.float32 else mx.float16)
    assert not table.serves(nn.RoPE(ROPES[rope]["dims"], traditional=True, base=1.0), dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_with_its_weights_view_held_computes_the_linears_own_product(bias):
    from mlx.utils import tree_flatten

    from runtime.fused import _linear
    linear = nn.Linear(48, 40, bias=bias)
    names = [name for name, _ in tree_flatten(linear.parameters())]
    for rows in (1, 5, 64):  # a decode row, a few, a slice: BLAS's paths differ
        x = mx.random.normal((rows, 48), key=mx.random.key(rows))
        assert mx.array_equal(_linear(linear, x), linear(x)).item()
    # The held view is no parameter; a replaced weight is read, not the view of the old one.
    assert [name for name, _ in tree_flatten(linear.parameters())] == names
    linear.weight = mx.random.normal((40, 48), key=mx.random.key(9))
    x = mx.random.normal((3, 48), key=mx.random.key(3))
    assert mx.array_equal(_linear(linear, x), linear(x)).item()
    quantized = nn.QuantizedLinear(64, 32, bias=bias)  # not a plain Linear: its own call
    x = mx.random.normal((2, 64), key=mx.random.key(4))
    assert mx.array_equal(_linear(quantized, x), quantized(x)).item()


def test_a_forward_reads_its_rope_angles_off_one_table_not_in_every_layer(monkeypatch):
    from runtime import rope_table
    monkeypatch.setattr(rope_table, "_POSITIONS", {})
    model = random_model(llama, model_type="llama")
    num_layers = len(model.model.layers)
    calls = []
    rope_call = nn.RoPE.__call__
    monkeypatch.setattr(nn.RoPE, "__call__",
                        lambda self, x, offset=0: calls.append(x.shape) or rope_call(self, x,
                                                                                    offset))

    def rope_calls(forward) -> int:
        segments = make_segments(model, 3, [5, 40], [(6, 9, True)])  # fills caches: ropes
        calls.clear()
        mx.eval(forward(model, segments))
        return len(calls)

    assert num_layers > 1
    assert rope_calls(forward_fused) == 1  # the table of positions, for every segment
    assert rope_calls(forward_fused) == 0  # ... held for the next forward
    assert rope_calls(forward_apart) == 2 * 2 * num_layers  # queries and keys, every layer
    # Prepared for a context (as an Executor prepares its model's), a forward computes none.
    monkeypatch.setattr(rope_table, "_POSITIONS", {})
    rope_table.prepare(model, 4096 * 3)
    assert [t[0].shape[0] for t in rope_table._POSITIONS.values()] == [4096 * 3]
    assert rope_calls(forward_fused) == 0


def test_a_tick_splits_its_slices_heads_and_spreads_its_rows_over_two_streams(monkeypatch):
    from runtime import attention
    from runtime.fused import attention_streams
    model = random_model(llama, model_type="llama")
    # Two decode batches (attention work, queries x keys attended, about: 2 x 301 = 602 and
    # 1 x 41 = 41), prefill slices of 64 and 8 tokens, and a slice of one token (a row, as far
    # as attention goes: 1 x 101 = 101).
    rows, big, tiny, one = make_segments(model, 4, [300, 300], [(64, 200, True), (8, 0, False),
                                                                (1, 100, False)])
    few_rows = make_segments(model, 5, [40], [])[0]
    monkeypatch.setattr(attention, "ATTENTION_STREAMS", 2)
    default, second = mx.default_stream(mx.cpu), attention.second_stream()
    assert default != second
    places = attention_streams([rows, big, tiny, one, few_rows])
    # Every slice of more than one token: its heads over both streams, half its work on each.
    assert places[1] == places[2] == (default, second)
    # The rest heaviest first, each to the stream with less work: rows (602) to the default,
    # the one-token slice (101) and the small batch (41) to the second.
    assert places[0] == (default,) and places[3] == places[4] == (second,)
    assert attention_streams([big]) == [(default, second)]  # alone, a prompt's chunk too
    monkeypatch.setattr(attention, "ATTENTION_STREAMS", 1)
    assert attention_streams([rows, big, tiny, one, few_rows]) == [(default,)] * 5


def test_a_slice_attends_in_two_halves_of_its_heads_on_two_streams(monkeypatch):
    # The wiring, not only the placement: with two streams every layer attends a prompt's
    # slice as two calls of half its heads each, on the two streams; with one, as one call.
    from runtime import attention, fused
    model = random_model(llama, model_type="llama")
    num_layers, num_heads = len(model.model.layers), model.args.num_attention_heads
    calls = []
    real = fused.attend

    def counting(queries, *args):
        calls.append((queries.shape[1], mx.default_stream(mx.cpu)))
        return real(queries, *args)

    monkeypatch.setattr(fused, "attend", counting)
    for streams in (2, 1):
        monkeypatch.setattr(attention, "ATTENTION_STREAMS", streams)
        calls.clear()
        mx.eval(forward_fused(model, make_segments(model, 7, [], [(16, 30, True)])))
        if streams == 2:
            halves = [(num_heads // 2, mx.default_stream(mx.cpu)),
                      (num_heads // 2, attention.second_stream())]
            assert calls == halves * num_layers
        else:
            assert calls == [(num_heads, mx.default_stream(mx.cpu))] * num_layers


def test_two_attention_streams_compute_what_one_does_bit_for_bit(monkeypatch):
    # Each segment runs the same ops on the same arrays, only on another thread: whatever the
    # BLAS or softmax, every logit and every cache entry is the same.
    from runtime import attention
    model = random_model(llama, model_type="llama")
    rows, slices = MIXES["rows and slices, some ending their prompt"]
    results = []
    for streams in (1, 2):
        monkeypatch.setattr(attention, "ATTENTION_STREAMS", streams)
        segments = make_segments(model, 6, rows, slices)
        logits = forward_fused(model, segments)
        mx.eval(logits)
        results.append((logits, [c.state[:2] for s in segments for c in s.cache]))
    (one, one_caches), (two, two_caches) = results
    assert one is not None and two is not None and mx.array_equal(one, two).item()
    for a, b in zip(one_caches, two_caches, strict=True):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def test_the_attention_streams_setting_is_checked(monkeypatch):
    from runtime.attention import attention_streams_setting
    monkeypatch.setenv("FAIRTICK_ATTENTION_STREAMS", "1")
    assert attention_streams_setting() == 1
    monkeypatch.setenv("FAIRTICK_ATTENTION_STREAMS", "4")
    with pytest.raises(ValueError, match=r"FAIRTICK_ATTENTION_STREAMS='4': expected one of "
                       r"\('1', '2'\)"):
        attention_streams_setting()


def _hand_overs(model, seed: int) -> tuple[Counter, mx.array]:
    # How often forward_fused, on this thread, evaluated arrays there and then ("eval") and
    # queued them for MLX's workers ("async"); and the logits it returns.
    from runtime import fused
    calls: Counter = Counter()
    real_eval, real_async = mx.eval, mx.async_eval
    me = threading.get_ident()

    def evaluating(*args):
        calls["eval"] += threading.get_ident() == me
        return real_eval(*args)

    def queueing(*args):
        calls["async"] += threading.get_ident() == me
        return real_async(*args)

    rows, slices = MIXES["rows and slices, some ending their prompt"]
    segments = make_segments(model, seed, rows, slices)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused.mx, "eval", evaluating)
        patch.setattr(fused.mx, "async_eval", queueing)
        logits = forward_fused(model, segments)
    real_eval(logits)
    return calls, logits


def test_layer_by_layer_evaluates_each_layer_before_building_the_next_with_the_same_logits():
    # MLX caps the tasks queued by all threads together, so a forward run beside another
    # thread's keeps at most a layer queued: each layer's output is evaluated, not queued,
    # before the next is built; the arrays it computes are the same.
    from runtime.fused import layer_by_layer
    model = random_model(llama, model_type="llama")
    between = len(model.model.layers) - 1  # hand-overs between layers (not after the last)
    _hand_overs(model, 8)  # the first forward of a shape evaluates tables it keeps
    queued, want = _hand_overs(model, 8)
    assert queued["async"] == between
    with layer_by_layer():
        with layer_by_layer():  # nested: still on, and the outer block's setting comes back
            pass
        evaluated, got = _hand_overs(model, 8)
    assert evaluated["async"] == 0 and evaluated["eval"] == queued["eval"] + between
    assert mx.array_equal(got, want).item()
    assert _hand_overs(model, 8)[0] == queued  # off again after it


def test_layer_by_layer_holds_only_for_the_thread_that_entered_it():
    from runtime.fused import layer_by_layer
    model = random_model(llama, model_type="llama")
    seen: list[Counter] = []

    def other_thread() -> None:
        try:
            seen.append(_hand_overs(model, 9)[0])
        finally:
            mx.clear_streams()  # a thread's MLX streams are freed by that thread

    with layer_by_layer():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert len(seen) == 1 and seen[0]["async"] == len(model.model.layers) - 1
