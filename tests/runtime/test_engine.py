"""The engine over the real built-in model: exactness, the admission scenario, aborts,
memory, EOS and stop strings, and a trace that only holds declared transitions."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from runtime.engine import Engine, EngineConfig
from runtime.model import ModelBundle
from statemachine.lifecycle import load_lifecycle
from statemachine.spec import shipped_policy_names
from tests.runtime.engine_harness import Collector, submit, wait_until

CHUNK = 32
NON_BASELINE = [n for n in shipped_policy_names() if n != "baseline"]


def make_engine(bundle: ModelBundle, policy: str, parallel: int = 4, **kw: object) -> Engine:
    engine = Engine(EngineConfig(parallel=parallel, prefill_chunk_size=CHUNK, policy=policy,
                                 check_invariants=policy != "baseline", **kw), bundle)
    engine.start()
    return engine


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def reference(bundle: ModelBundle, tokens: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(tokens), bundle.model, max_tokens=n)]


@pytest.mark.parametrize("policy", shipped_policy_names())
def test_batched_chunked_output_equals_unbatched_greedy(bundle, policy):
    lengths = [1, 20, CHUNK, 70, 150]
    engine, got = make_engine(bundle, policy), Collector()
    try:
        for i, n in enumerate(lengths):
            submit(engine, got, f"r{i}", prompt(n, i), max_tokens=12)
        got.wait(*(f"r{i}" for i in range(len(lengths))))
    finally:
        engine.stop()
    for i, n in enumerate(lengths):
        assert got.tokens(f"r{i}") == reference(bundle, prompt(n, i), 12), f"prompt of {n}"
        assert got.last(f"r{i}").finish_reason == "length"
        assert got.last(f"r{i}").num_generated_tokens == 12


def admission_scenario(bundle: ModelBundle, policy: str) -> tuple[Collector, list[str]]:
    engine, got = make_engine(bundle, policy, parallel=5), Collector()
    streams = [f"s{i}" for i in range(4)]
    try:
        for i, rid in enumerate(streams):
            submit(engine, got, rid, prompt(8, 100 + i), max_tokens=150)
        wait_until(lambda: all(len(got.tokens(r)) >= 2 for r in streams[:1]))
        submit(engine, got, "long", prompt(6 * CHUNK, 7), max_tokens=4)
        got.wait(*streams, "long")
    finally:
        engine.stop()
    return got, streams


@pytest.mark.parametrize("policy", NON_BASELINE)
def test_a_prompt_admitted_into_a_busy_batch_gets_its_token_while_they_decode(bundle, policy):
    got, streams = admission_scenario(bundle, policy)
    first = got.first_token_time("long")
    for rid in streams:
        assert got.events[rid][-1][0] > first, f"{rid} finished before the prompt's first token"


def test_under_baseline_the_prompt_waits_for_the_batch_to_drain(bundle):
    got, streams = admission_scenario(bundle, "baseline")
    first = got.first_token_time("long")
    assert all(got.events[rid][-1][0] < first for rid in streams)


def test_abort_in_every_state_frees_slot_and_cache(bundle):
    engine, got = make_engine(bundle, "baseline", parallel=2), Collector()
    try:
        submit(engine, got, "decoding", prompt(4, 1), max_tokens=10_000)
        wait_until(lambda: len(got.tokens("decoding")) >= 3)
        submit(engine, got, "parked", prompt(3 * CHUNK, 2), max_tokens=4)  # baseline parks it
        submit(engine, got, "waiting", prompt(4, 3), max_tokens=4)  # no slot left
        wait_until(lambda: {s["state"] for s in engine.snapshot()["sequences"]}
                   == {"decoding", "parked_prefill", "waiting"})
        for rid in ("waiting", "parked", "decoding"):
            engine.abort(rid)
            got.wait(rid)
            assert got.last(rid).finish_reason == "abort"
        wait_until(lambda: not engine.snapshot()["sequences"])
        assert engine.executor.num_sequences == 0
    finally:
        engine.stop()
    states = {(e["seq"], e["to"]) for e in engine.trace.events() if e["trigger"] == "abort"}
    assert len(states) == 3


def test_abort_mid_prefill_stops_the_work(bundle):
    engine, got = make_engine(bundle, "prefill_priority", parallel=1), Collector()
    try:
        submit(engine, got, "big", prompt(40 * CHUNK, 4), max_tokens=4)
        wait_until(lambda: any(e["trigger"] == "chunk_done" for e in engine.trace.events()))
        engine.abort("big")
        got.wait("big")
        wait_until(lambda: engine.executor.num_sequences == 0)
        chunks = sum(e["trigger"] == "chunk_done" for e in engine.trace.events())
    finally:
        engine.stop()
    assert got.last("big").finish_reason == "abort" and chunks < 40


def test_many_sequences_leave_no_memory_behind(bundle):
    engine, got = make_engine(bundle, "mixed_step", parallel=8), Collector()
    try:
        submit(engine, got, "warm", prompt(50, 0), max_tokens=5)
        got.wait("warm")
        wait_until(lambda: engine.executor.num_sequences == 0)
        start = mx.get_active_memory()
        ids = [f"r{i}" for i in range(24)]
        for i, rid in enumerate(ids):
            submit(engine, got, rid, prompt(10 + 7 * i, i), max_tokens=5 + i % 7)
        got.wait(*ids)
        wait_until(lambda: engine.executor.num_sequences == 0)
        assert mx.get_active_memory() == start
        assert engine.snapshot()["sequences"] == []
    finally:
        engine.stop()


def test_eos_stops_unless_ignored(eos_bundle):
    engine, got = make_engine(eos_bundle, "mixed_step"), Collector()
    try:
        for i in range(12):
            submit(engine, got, f"p{i}", prompt(10, i), max_tokens=48)
            submit(engine, got, f"i{i}", prompt(10, i), max_tokens=48, ignore_eos=True)
        got.wait(*(f"{k}{i}" for k in "pi" for i in range(12)))
    finally:
        engine.stop()
    stopped = [i for i in range(12) if got.last(f"p{i}").finish_reason == "stop"]
    assert stopped, "the EOS-capable model never produced EOS"
    for i in stopped:
        assert got.last(f"i{i}").finish_reason == "length"
        assert len(got.tokens(f"i{i}")) == 48 > len(got.tokens(f"p{i}"))


def test_stop_string_ends_the_text_before_it(bundle):
    engine, got = make_engine(bundle, "deadline"), Collector()
    try:
        submit(engine, got, "free", prompt(12, 9), max_tokens=20)
        got.wait("free")
        full = got.text("free")
        stop = full[6:9]
        submit(engine, got, "stopped", prompt(12, 9), max_tokens=20, stop=(stop,))
        got.wait("stopped")
    finally:
        engine.stop()
    assert got.last("stopped").finish_reason == "stop"
    assert got.text("stopped") == full[: full.index(stop)]


def test_trace_holds_only_declared_transitions(bundle):
    engine, got = make_engine(bundle, "grant_counter", parallel=2), Collector()
    try:
        for i in range(5):
            submit(engine, got, f"r{i}", prompt(20 + 30 * i, i), max_tokens=6)
        engine.abort("r4")
        got.wait(*(f"r{i}" for i in range(5)))
    finally:
        engine.stop()
    edges = {(e.source, e.trigger, e.dest) for e in load_lifecycle().edges}
    events = engine.trace.events()
    assert {e["trigger"] for e in events} >= {"admit", "grant", "chunk_done", "finish"}
    assert all((e["from"], e["trigger"], e["to"]) in edges for e in events)


def test_a_fault_in_one_request_fails_only_that_request(bundle):
    engine, got = make_engine(bundle, "mixed_step"), Collector()
    poisoned = prompt(40, 5)
    real_run = engine.executor.run

    def run(prefills, decode):  # fault injection: a tick with the poisoned prompt's prefill
        if any(engine.executor.prompt_left(w.seq_id) == len(poisoned) for w in prefills):
            raise RuntimeError("injected fault")
        return real_run(prefills, decode)

    engine.executor.run = run
    try:
        submit(engine, got, "ok1", prompt(10, 1), max_tokens=30)
        submit(engine, got, "bad", poisoned, max_tokens=30)
        submit(engine, got, "ok2", prompt(50, 2), max_tokens=30)
        got.wait("ok1", "bad", "ok2")
        assert engine.alive
        submit(engine, got, "after", prompt(10, 3), max_tokens=5)
        got.wait("after")
        wait_until(lambda: engine.executor.num_sequences == 0)
    finally:
        engine.stop()
    assert got.last("bad").finish_reason == "error" and "injected fault" in got.last("bad").error
    for rid, n in (("ok1", 30), ("ok2", 30), ("after", 5)):
        assert got.last(rid).finish_reason == "length" and len(got.tokens(rid)) == n
    assert engine.admission.kv_tokens == 0 and engine.admission.num_queued == 0


def test_kv_budget_and_queue_bound_refuse_at_once(bundle):
    from runtime.api import EngineFull

    engine, got = make_engine(bundle, "mixed_step", parallel=1, max_waiting=1,
                              max_kv_tokens=300), Collector()
    try:
        with pytest.raises(ValueError, match="whole budget"):
            submit(engine, got, "huge", prompt(290, 0), max_tokens=20)
        submit(engine, got, "a", prompt(100, 1), max_tokens=100)  # 200 of 300 KV tokens
        wait_until(lambda: got.tokens("a"))  # "a" holds the only slot; nothing is queued
        with pytest.raises(EngineFull, match="KV tokens"):
            submit(engine, got, "b", prompt(100, 2), max_tokens=100)
        submit(engine, got, "c", prompt(10, 3), max_tokens=20)  # queued: 230 of 300
        with pytest.raises(EngineFull, match="already waiting"):
            submit(engine, got, "d", prompt(10, 4), max_tokens=20)
        got.wait("a", "c")
        wait_until(lambda: engine.admission.kv_tokens == 0)
        submit(engine, got, "e", prompt(100, 5), max_tokens=100)  # the budget is free again
        got.wait("e")
    finally:
        engine.stop()
    assert [got.last(r).finish_reason for r in "ace"] == ["length"] * 3
    assert engine.admission.num_queued == 0


def test_a_request_racing_the_engines_death_is_answered_and_released(bundle, monkeypatch):
    engine, got = make_engine(bundle, "mixed_step"), Collector()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scheduler broke")

    engine.scheduler.schedule = broken  # the engine thread dies at its next tick
    submit(engine, got, "first", prompt(5, 0), max_tokens=3)
    got.wait("first")
    wait_until(lambda: not engine.alive)
    # The next request passes the alive check, as if the thread died just after it.
    checks = iter([True])
    monkeypatch.setattr(Engine, "alive", property(lambda self: next(checks, False)))
    submit(engine, got, "late", prompt(5, 1), max_tokens=3)
    got.wait("late", timeout=5)
    engine.stop(grace_s=0)
    assert got.last("late").finish_reason == "error" and "scheduler broke" in got.last("late").error
    assert engine.admission.kv_tokens == 0 and engine.admission.num_queued == 0
