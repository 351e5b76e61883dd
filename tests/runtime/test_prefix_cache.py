"""The prefix cache: its lookups over real MLX arrays, and the engine over the real built-in
model, where greedy output with a cache hit must equal mlx-lm's own generation of the same
prompt (and so a cold engine's): across chunk boundaries, partial blocks, concurrent requests
sharing a prefix, chat turns, and after eviction, within the KV budget."""

from __future__ import annotations

import mlx.core as mx
import pytest

from runtime.api import GenerationRequest
from runtime.engine import Engine, EngineConfig
from runtime.executor import Executor
from runtime.model import ModelBundle
from runtime.prefix_cache import BLOCK_TOKENS, PrefixCache
from runtime.sampling import SamplingParams
from statemachine.lifecycle import Trigger
from tests.runtime.engine_harness import Collector, submit, wait_until
from tests.runtime.test_engine import CHUNK, prompt, reference

MAX = 8


def kv(tokens: list[int]) -> list[tuple[mx.array, mx.array]]:
    # One layer whose keys name each position's token, so a slice shows what it holds.
    keys = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
    return [(keys, -keys)]


def test_lookup_finds_the_longest_prefix_ending_inside_a_block():
    cache = PrefixCache(10_000)
    a, b = prompt(100, 1), prompt(100, 2)
    cache.insert(a, kv(a))
    cache.insert(b, kv(b))
    hit = cache.lookup(a[:53] + [0, 0, 0])
    assert hit is not None and hit.num_tokens == 53
    keys = hit.layers[0][0][..., :hit.num_tokens, :]
    assert keys.reshape(-1).tolist() == a[:53]
    assert cache.lookup(prompt(100, 3)) is None
    assert cache.lookup(a[:BLOCK_TOKENS - 1] + [0] * 40) is None, "no whole block in common"


def test_a_whole_cached_prompt_leaves_its_last_token_to_run():
    cache = PrefixCache(10_000)
    a = prompt(64, 1)
    cache.insert(a, kv(a))
    hit = cache.lookup(a)
    assert hit is not None and hit.num_tokens == len(a) - 1
    hit = cache.lookup(a[:40])
    assert hit is not None and hit.num_tokens == 39


def test_an_entry_that_a_later_turn_extends_is_replaced_by_it():
    cache = PrefixCache(10_000)
    turn1 = prompt(70, 1)
    turn2 = turn1 + prompt(50, 2)
    cache.insert(turn1, kv(turn1))
    cache.insert(turn2, kv(turn2))
    assert (len(cache), cache.num_tokens) == (1, len(turn2))
    cache.insert(turn1, kv(turn1))  # already inside turn2's entry
    assert (len(cache), cache.num_tokens) == (1, len(turn2))


def test_least_recently_used_entries_are_evicted_first():
    cache = PrefixCache(250)
    a, b, c = prompt(100, 1), prompt(100, 2), prompt(100, 3)
    cache.insert(a, kv(a))
    cache.insert(b, kv(b))
    assert cache.lookup(a + [1]) is not None  # a is now the most recently used
    cache.insert(c, kv(c))
    assert cache.lookup(b + [1]) is None
    assert cache.lookup(a + [1]) is not None and cache.lookup(c + [1]) is not None
    assert (cache.num_evictions, cache.num_tokens) == (1, 200)
    assert cache.shrink_to(0) == 200 and len(cache) == 0


# -- the engine ------------------------------------------------------------------------------
def make_engine(bundle: ModelBundle, **kw: object) -> Engine:
    config = {"max_running": 4, "prefill_chunk_size": CHUNK, "policy": "mixed_step",
              "check_invariants": True, **kw}
    engine = Engine(EngineConfig(**config), bundle)  # type: ignore[arg-type]
    engine.start()
    return engine


def run(engine: Engine, got: Collector, requests: dict[str, list[int]]) -> None:
    """Submit the requests at once, wait for them, and for their KV to reach the cache."""
    for rid, tokens in requests.items():
        submit(engine, got, rid, tokens, max_tokens=MAX)
    got.wait(*requests)
    wait_until(lambda: engine.executor.num_sequences == 0)


def assert_exact(bundle: ModelBundle, got: Collector, requests: dict[str, list[int]]) -> None:
    for rid, tokens in requests.items():
        assert got.tokens(rid) == reference(bundle, tokens, MAX), rid


def cached(got: Collector, rid: str) -> int:
    return got.last(rid).num_cached_tokens


@pytest.mark.parametrize("length", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7, 150])
def test_a_hit_across_chunk_and_block_boundaries_gives_the_cold_output(bundle, length):
    base = prompt(length, 1)
    engine, got = make_engine(bundle), Collector()
    try:
        run(engine, got, {"first": base + prompt(20, 2)})
        # The whole prefix, the prefix cut inside a block, and the first prompt again.
        later = {"whole": base + prompt(25, 3), "cut": base[: length - 5] + prompt(9, 4),
                 "again": base + prompt(20, 2)}
        for rid, tokens in later.items():
            run(engine, got, {rid: tokens})
    finally:
        engine.stop()
    assert cached(got, "first") == 0
    assert cached(got, "whole") >= length and cached(got, "cut") >= length - 5
    assert cached(got, "again") == length + 20 - 1, "all but the last prompt token"
    assert_exact(bundle, got, {"first": base + prompt(20, 2), **later})


def test_concurrent_requests_share_a_cached_prefix(bundle):
    system = prompt(3 * CHUNK + 5, 7)
    requests = {f"user{i}": system + prompt(10 + 9 * i, 20 + i) for i in range(4)}
    engine, got = make_engine(bundle), Collector()
    try:
        run(engine, got, {"warm": system + [65]})
        run(engine, got, requests)
        trace = engine.trace.events()
    finally:
        engine.stop()
    for rid in requests:
        assert cached(got, rid) == len(system)
        [arrival] = [e for e in trace if e["kind"] == "arrival" and e["request_id"] == rid]
        assert arrival["cached_tokens"] == len(system)
    assert_exact(bundle, got, requests)


def test_chat_turns_reuse_the_conversation_so_far(bundle):
    engine, got, turn = make_engine(bundle), Collector(), prompt(90, 1)
    turns = {}
    try:
        for i in range(3):
            turns[f"turn{i}"] = turn
            run(engine, got, {f"turn{i}": turn})
            turn = turn + got.tokens(f"turn{i}") + prompt(15, 10 + i)
    finally:
        engine.stop()
    for i in (1, 2):
        # The previous turn's prompt and its answer but the last token (never in the KV).
        before = turns[f"turn{i - 1}"]
        assert cached(got, f"turn{i}") == len(before) + MAX - 1
    assert_exact(bundle, got, turns)


def test_after_eviction_a_request_prefills_again_and_stays_exact(bundle):
    a, b = prompt(120, 1), prompt(120, 2)
    engine, got = make_engine(bundle, prefix_cache_tokens=150), Collector()
    try:
        run(engine, got, {"a": a})
        run(engine, got, {"b": b})  # a's entry leaves to make room for b's
        run(engine, got, {"a2": a + [70], "b2": b + [70]})
        evictions = engine.metrics.prefix_cache_evictions._value.get()
    finally:
        engine.stop()
    assert evictions >= 1
    assert (cached(got, "a2"), cached(got, "b2")) == (0, len(b))
    assert_exact(bundle, got, {"a": a, "b": b, "a2": a + [70], "b2": b + [70]})


def test_a_request_that_opts_out_neither_uses_nor_fills_the_cache(bundle):
    a = prompt(80, 1)
    engine, got = make_engine(bundle), Collector()
    try:
        run(engine, got, {"a": a})
        engine.submit(GenerationRequest("private", tuple(a + [70]), SamplingParams(max_tokens=MAX),
                                        cache_prompt=False), got.sink)
        got.wait("private")
        wait_until(lambda: engine.executor.num_sequences == 0)
        held = engine.prefix_cache.num_tokens if engine.prefix_cache else None
    finally:
        engine.stop()
    assert cached(got, "private") == 0
    assert held == len(a) + MAX - 1, "only the first request's KV"
    assert_exact(bundle, got, {"private": a + [70]})


def test_the_cache_gives_way_to_a_request_that_needs_the_whole_kv_budget(bundle):
    budget = 300
    engine, got = make_engine(bundle, max_kv_tokens=budget, policy="token_budget"), Collector()
    fill = {f"fill{i}": prompt(100, 30 + i) for i in range(4)}
    big = prompt(budget - MAX, 9)
    try:
        for rid, tokens in fill.items():
            run(engine, got, {rid: tokens})
        held = engine.prefix_cache.num_tokens if engine.prefix_cache else 0
        run(engine, got, {"big": big})
        trace = engine.trace.events()
        preempted = sum(engine.metrics.preemptions.labels(k)._value.get()
                        for k in ("drop", "pause"))
        evictions = engine.metrics.prefix_cache_evictions._value.get()
    finally:
        engine.stop()
    assert held >= 2 * (100 + MAX - 1), "the cache held several requests' KV"
    stops = (Trigger.PREEMPT.value, Trigger.PAUSE.value)
    assert preempted == 0 and not [e for e in trace if e["trigger"] in stops]
    assert evictions >= 2
    assert_exact(bundle, got, {"big": big})


def test_a_prompt_that_ends_at_its_first_token_is_kept_and_a_hit_on_it_is_exact(bundle):
    # It never decodes: its KV is kept from its own buffers, not copied out of the batch's.
    base, more = prompt(3 * CHUNK + 5, 4), prompt(9, 5)
    engine, got = make_engine(bundle), Collector()
    try:
        submit(engine, got, "first", base, max_tokens=1)
        got.wait("first")
        wait_until(lambda: engine.executor.num_sequences == 0)
        run(engine, got, {"again": base + more})
    finally:
        engine.stop()
    assert cached(got, "again") == len(base)
    assert_exact(bundle, got, {"again": base + more})


def test_a_sequence_leaving_its_own_buffers_is_kept_without_a_copy(bundle):
    # A copy of a long prompt's KV is a stall of every stream in the tick it ends; its own
    # buffers (sized to the prompt, one cache step at most past it) are kept as they are.
    ex, tokens = Executor(bundle), prompt(700, 6)
    ex.add(1, tokens, SamplingParams(max_tokens=1))
    ex.prefill(1, len(tokens))
    mx.eval([c.keys for c in ex._get(1).cache])
    before = mx.get_active_memory()
    kept, layers = ex.kv_of(1)
    grown = mx.get_active_memory() - before
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in layers)
    assert kept == tokens
    assert grown < kv_bytes / 10, f"{grown} bytes allocated for {kv_bytes} of KV"
    for (k, v), c in zip(layers, ex._get(1).cache, strict=True):
        assert k.shape[2] == v.shape[2] == len(tokens)
        assert mx.array_equal(k, c.keys[..., :len(tokens), :]).item()
        assert mx.array_equal(v, c.values[..., :len(tokens), :]).item()
