"""The load a replica reports, measured on a real engine, and the order the router tries
replicas in (cluster.load; no Ray needed)."""

from __future__ import annotations

import random
import time

from cluster.load import Candidate, ReplicaLoad, engine_load, estimate_tokens, rank_replicas
from runtime.engine import Engine, EngineConfig
from tests.runtime.engine_harness import Collector, hold, submit, wait_until

LONG_PROMPT = 2000


def test_a_parked_long_prompt_is_reported_and_ranks_its_replica_last(bundle, monkeypatch):
    engine = Engine(EngineConfig(max_kv_tokens=8000, prefill_chunk_size=64), bundle)
    assert not engine_load(engine, time.time()).alive  # not started yet
    engine.start()
    gate = hold(monkeypatch, engine.executor, "run")  # the first tick, as it runs its slice
    collector = Collector()
    try:
        submit(engine, collector, "long", [65] * LONG_PROMPT, max_tokens=4)
        gate.wait_entered()
        busy = engine_load(engine, time.time())
    finally:
        gate.open()
    collector.wait("long")
    wait_until(lambda: engine_load(engine, time.time()).kv_used_tokens == 0)
    idle = engine_load(engine, time.time())
    engine.stop(grace_s=0)
    assert (idle.waiting, idle.decoding, idle.prefill_tokens) == (0, 0, 0)
    assert idle.alive and idle.kv_budget_tokens == 8000
    assert busy.prefill_tokens == LONG_PROMPT  # nothing prefilled before the first slice ends
    assert busy.alive and busy.waiting == 0  # admitted: it holds the KV its slice writes
    loads = {"busy": busy, "idle": idle}
    for seed in range(8):
        order = rank_replicas([Candidate(name, load) for name, load in loads.items()],
                              request_tokens=20, rng=random.Random(seed))
        assert order == ["idle", "busy"]


def _load(**fields: object) -> ReplicaLoad:
    base = {"time_s": 0.0, "alive": True, "waiting": 0, "decoding": 0, "prefill_tokens": 0,
            "kv_used_tokens": 0, "kv_budget_tokens": 10_000}
    return ReplicaLoad(**{**base, **fields})  # type: ignore[arg-type]


def test_the_rank_orders_by_liveness_kv_room_prefill_ahead_then_streams():
    dead = Candidate("dead", _load(alive=False))
    full = Candidate("full", _load(kv_used_tokens=9_990))  # a 20-token request does not fit
    parked = Candidate("parked", _load(prefill_tokens=5_000, kv_used_tokens=100))
    streams = Candidate("streams", _load(decoding=12, kv_used_tokens=2_000))
    quiet = Candidate("quiet", _load(decoding=1, kv_used_tokens=200))
    for seed in range(8):
        order = rank_replicas([dead, full, parked, streams, quiet], 20, random.Random(seed))
        assert order == ["quiet", "streams", "parked", "full", "dead"]


def test_requests_sent_since_the_last_report_count_as_load():
    # Both reported idle; one was sent a 10k-token prompt after its report.
    sent = Candidate("sent", _load(), unreported_tokens=10_000, unreported_requests=1)
    other = Candidate("other", _load())
    assert rank_replicas([sent, other], 20, random.Random(0)) == ["other", "sent"]
    # A short chat sent since the report still spreads the next request to the other replica.
    chat = Candidate("chat", _load(), unreported_tokens=0, unreported_requests=1)
    assert rank_replicas([chat, other], 20, random.Random(0)) == ["other", "chat"]


def test_ties_are_broken_at_random_and_unreported_replicas_count_as_idle():
    a, b = Candidate("a", None), Candidate("b", _load())
    firsts = {rank_replicas([a, b], 20, random.Random(seed))[0] for seed in range(16)}
    assert firsts == {"a", "b"}


def test_stats_round_trip_and_empty_stats_are_no_report():
    load = _load(waiting=3, prefill_tokens=7)
    assert ReplicaLoad.from_stats(load.to_stats()) == load
    assert ReplicaLoad.from_stats({}) is None  # Ray's stats before the first report
    assert ReplicaLoad.from_stats({"waiting": 1}) is None
    assert estimate_tokens(40_000) > estimate_tokens(400) > 0
