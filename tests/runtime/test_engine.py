"""The engine over the real built-in model: exactness, the admission scenario, aborts,
memory, EOS and stop strings, and a trace that only holds declared transitions.

Nothing here waits on the clock: a test waits for the event it needs (a token, a state in the
engine's snapshot, the engine thread inside a held call) and reads the order of events from the
trace or from the order the engine published them."""

from __future__ import annotations

import random
import threading
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from runtime import kernels
from runtime.api import GenerationRequest
from runtime.engine import Engine, EngineConfig
from runtime.model import ModelBundle
from runtime.sampling import SamplingParams
from statemachine.invariants import implied_ttft
from statemachine.lifecycle import Trigger, load_lifecycle
from statemachine.spec import POLICIES_DIR, shipped_policy_names
from tests.lifecycle_names import ABORT, CHUNK_DONE, DECODING, PARKED, PREFILLING, WAITING
from tests.runtime.engine_harness import Collector, hold, submit, wait_until

CHUNK = 32
NON_BASELINE = [n for n in shipped_policy_names() if n != "baseline"]
# Tokens a stream may decode before the prompt is admitted; streams outlast it by the claim.
MARGIN_TICKS = 40


def make_engine(bundle: ModelBundle, policy: str, max_running: int = 4,
                **kw: object) -> Engine:
    engine = Engine(EngineConfig(max_running=max_running, prefill_chunk_size=CHUNK,
                                 policy=policy, check_invariants=policy != "baseline", **kw),
                    bundle)
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
    """Three streams decode; then a prompt of three chunks arrives, with room for it (KV and a
    running place). The streams are longer than the TTFT its policy's claims give that prompt
    (admitted at once, never preempted: the wait bound alone), so under a policy that keeps its
    claims none of them can finish before the prompt's first token."""
    running, chunks = 4, 3
    engine, got = make_engine(bundle, policy, max_running=running), Collector()
    wait = engine.policy.claim("wait_ticks", max_running=running)
    claim = implied_ttft(chunks, wait, 0, 0)
    stream_tokens = (claim or 0) + MARGIN_TICKS
    streams = [f"s{i}" for i in range(running - 1)]
    try:
        for i, rid in enumerate(streams):
            submit(engine, got, rid, prompt(8, 100 + i), max_tokens=stream_tokens)
        wait_until(lambda: all(len(got.tokens(r)) >= 2 for r in streams[:1]))
        submit(engine, got, "long", prompt(chunks * CHUNK, 7), max_tokens=4)
        # The prompt is admitted at the next tick: at most one more token per stream.
        ahead = max(len(got.tokens(r)) for r in streams) + 1
        got.wait(*streams, "long")
    finally:
        engine.stop()
    if claim is not None:
        assert stream_tokens - ahead > claim, (
            f"not a fair test: the streams had {stream_tokens - ahead} tokens left when the "
            f"prompt came, its TTFT claim is {claim} ticks; raise MARGIN_TICKS")
    return got, streams


@pytest.mark.parametrize("policy", NON_BASELINE)
def test_a_prompt_admitted_into_a_busy_batch_gets_its_token_while_they_decode(bundle, policy):
    got, streams = admission_scenario(bundle, policy)
    first = got.first_token_order("long")
    for rid in streams:
        assert got.last_order(rid) > first, f"{rid} finished before the prompt's first token"


def test_while_a_prompt_is_parked_the_engine_probes_the_streams_own_step(bundle, monkeypatch):
    # token_budget sizes slices to a target stated in the streams' decode step, which slows as
    # their contexts grow while the prompt prefills: the first parked ticks and then one in
    # `every` run the decode rows in a forward of their own (timed), then the slice in its own.
    engine = make_engine(bundle, "token_budget")
    calls: list[tuple[list[tuple[int, int]], list[int]]] = []
    run = engine.executor.run

    def spy(prefills, decode):
        calls.append(([(w.seq_id, w.num_tokens) for w in prefills], list(decode)))
        return run(prefills, decode)

    monkeypatch.setattr(engine.executor, "run", spy)
    got, streams = Collector(), ["s0", "s1"]
    long = prompt(3000, 7)
    try:
        for i, rid in enumerate(streams):
            submit(engine, got, rid, prompt(8, 100 + i), max_tokens=1000)
        wait_until(lambda: all(len(got.tokens(r)) >= 20 for r in streams))
        submit(engine, got, "long", long, max_tokens=4)
        got.wait("long")
        for rid in streams:
            engine.abort(rid)
        got.wait(*streams)
    finally:
        engine.stop()
    assert got.tokens("long") == reference(bundle, long, 4)
    # Ticks with the prompt's slices while the streams decoded: one call, or a probe's two.
    # The prompt is the one sequence prefilled over many ticks (each stream's took one).
    slices = Counter(seq_id for prefills, _ in calls for seq_id, _ in prefills)
    long_id = slices.most_common(1)[0][0]
    ticks, i = [], 0
    while i < len(calls):
        prefills, decode = calls[i]
        if prefills == [] and decode and i + 1 < len(calls) and calls[i + 1][0] and \
                calls[i + 1][0][0][0] == long_id and not calls[i + 1][1]:
            ticks.append(("probe", calls[i + 1][0][0][1]))
            i += 2
            continue
        if prefills and prefills[0][0] == long_id and decode:
            ticks.append(("fused", prefills[0][1]))
        i += 1
    kinds = [kind for kind, _ in ticks]
    first, every = engine.budget.pace.baseline, engine.budget.pace.every
    assert len(ticks) > first + 2 * every, "too few parked ticks to see later probes"
    assert kinds[:first + 1] == ["probe"] * first + ["fused"]
    later = [j for j, kind in enumerate(kinds) if kind == "probe" and j >= first]
    # A probe's slice fills what the rows' step leaves of the target: more than the min slice
    # once slices have grown.
    assert all(n >= 1 for kind, n in ticks if kind == "probe")
    assert max(ticks[j][1] for j in later) > 1
    assert later and later[0] == first - 1 + every
    assert [b - a for a, b in zip(later, later[1:], strict=False)] == [every] * (len(later) - 1)
    # Every forward of slices alone is priced as a tick without decode rows: a prompt's ticks
    # with nothing decoding, and each probe's slice forward (its rows' forward is not).
    records = engine.budget.costs.records
    alone = [r for r in records if r.shape.slices and not r.shape.decode_contexts]
    assert len(alone) == sum(1 for prefills, decode in calls if prefills and not decode)
    # Each tick sized for the target is timed against it, probes apart (/metrics): every probe
    # (the streams' own prompts were parked beside a decoding stream too: a rows' forward, then
    # a slice's), and the fused ticks sized once the streams' step was measured.
    def observed(kind: str, sample: str) -> float:
        value = engine.registry.get_sample_value(f"fairtick_tick_over_target_ratio_{sample}",
                                                 {"kind": kind})
        return value or 0.0
    probes = sum(1 for (p0, d0), (p1, d1) in zip(calls, calls[1:], strict=False)
                 if not p0 and d0 and p1 and not d1)
    assert probes > kinds.count("probe")
    assert observed("probe", "count") == probes
    assert kinds.count("fused") <= observed("mixed", "count") <= sum(
        1 for prefills, decode in calls if prefills and decode)
    assert observed("probe", "sum") > 0 and observed("mixed", "sum") > 0


def test_in_a_lane_tick_the_streams_step_beside_the_prompts_slice_and_stay_exact(bundle,
                                                                               monkeypatch):
    # token_budget_lane (ADR 0016): the prompt's slice runs on the lane thread while the
    # streams step on the engine thread, more than once in some ticks; every token is still
    # mlx-lm's, and the scheduler counts every step (its own check runs each tick).
    engine = Engine(EngineConfig(max_running=4, prefill_chunk_size=256,
                                 policy="token_budget_lane", check_invariants=True,
                                 policy_params={"lane_pace": 0.1}), bundle)
    engine.start()
    got = Collector()
    extras: list[int] = []
    real_complete = engine.scheduler.complete

    def complete(plan, finished=(), extra=0):
        if plan.prefills and plan.decode:
            extras.append(extra)
        return real_complete(plan, finished, extra)

    monkeypatch.setattr(engine.scheduler, "complete", complete)
    steps: list[int] = []  # the decode rows' forwards (the lane's slices have none)
    run = engine.executor.run

    def spy(prefills, decode):
        if decode:
            steps.append(len(decode))
        return run(prefills, decode)

    monkeypatch.setattr(engine.executor, "run", spy)
    streams = {f"s{i}": prompt(8, 200 + i) for i in range(3)}
    long = prompt(1500, 9)
    try:
        for rid, tokens in streams.items():
            submit(engine, got, rid, tokens, max_tokens=120, logprobs=0)
        wait_until(lambda: all(len(got.tokens(r)) >= 2 for r in streams))
        submit(engine, got, "long", long, max_tokens=6, logprobs=0)
        got.wait(*streams, "long")
    finally:
        engine.stop()
    assert extras and max(extras) > 0, extras  # some lane tick's streams stepped again
    # /metrics counts every step the rows took, a lane tick's extra ones too.
    assert engine.registry.get_sample_value("fairtick_decode_steps_total") == len(steps)
    for rid, tokens in streams.items():
        assert got.tokens(rid) == reference(bundle, tokens, 120), rid
    assert got.tokens("long") == reference(bundle, long, 6)
    # Every token with its log-probability: the streams' steps publish theirs only, never the
    # prompt's first token's, which the lane commits meanwhile.
    for rid in (*streams, "long"):
        assert all(e.logprob is not None for _, e in got.events[rid] if e.token_id is not None)


def test_a_lane_that_cannot_start_fails_the_engine_instead_of_hanging_it(bundle, monkeypatch):
    # The lane's thread warms its kernels before the engine's first tick; when that fails the
    # engine thread dies with the cause (requests are refused, /health says so) instead of
    # waiting for ever on the first lane tick's slice, which no thread would run.
    real = kernels.warm_up

    def warm_up() -> None:
        if threading.current_thread().name == "prefill-lane":
            raise OSError("no kernels on this thread")
        real()

    monkeypatch.setattr(kernels, "warm_up", warm_up)
    engine = make_engine(bundle, "token_budget_lane")
    try:
        wait_until(lambda: not engine.alive, timeout=10)
    finally:
        engine.stop()
    assert isinstance(engine.error, RuntimeError), engine.error
    assert "prefill lane could not start" in str(engine.error)
    assert "no kernels on this thread" in str(engine.error)


def test_a_lane_tick_whose_next_step_cannot_be_queued_goes_on(bundle, monkeypatch, caplog):
    # A lane tick queues the rows' next step after publishing their tokens; where that fails
    # (the executor leaves the batch as it was), the next step runs itself: the streams and
    # the prompt still get mlx-lm's tokens and the engine lives.
    engine = make_engine(bundle, "token_budget_lane")
    calls: list[list[int]] = []

    def queue_step(rows: list[int]) -> None:
        calls.append(rows)
        raise RuntimeError("no room to queue")

    monkeypatch.setattr(engine.executor, "queue_step", queue_step)
    got = Collector()
    streams = {f"s{i}": prompt(8, 300 + i) for i in range(2)}
    long = prompt(900, 19)
    try:
        for rid, tokens in streams.items():
            submit(engine, got, rid, tokens, max_tokens=60)
        wait_until(lambda: all(len(got.tokens(r)) >= 2 for r in streams))
        submit(engine, got, "long", long, max_tokens=4)
        got.wait(*streams, "long")
    finally:
        engine.stop()
    assert calls and engine.error is None
    assert "could not be queued" in caplog.text
    for rid, tokens in streams.items():
        assert got.tokens(rid) == reference(bundle, tokens, 60), rid
    assert got.tokens("long") == reference(bundle, long, 4)


def test_under_baseline_the_prompt_waits_for_the_batch_to_drain(bundle):
    got, streams = admission_scenario(bundle, "baseline")
    first = got.first_token_order("long")
    assert all(got.last_order(rid) < first for rid in streams)


def test_abort_in_every_state_between_ticks_frees_slot_and_cache(bundle):
    # Aborts are applied between ticks, so a sequence is aborted from waiting, parked or
    # decoding; one whose chunk is running is aborted after it (the next test).
    engine, got = make_engine(bundle, "baseline", max_running=2), Collector()
    expected = {"stream": DECODING, "long": PARKED, "queued": WAITING}
    try:
        submit(engine, got, "stream", prompt(4, 1), max_tokens=10_000)
        wait_until(lambda: len(got.tokens("stream")) >= 3)
        submit(engine, got, "long", prompt(3 * CHUNK, 2), max_tokens=4)  # baseline parks it
        submit(engine, got, "queued", prompt(4, 3), max_tokens=4)  # no running place left
        wait_until(lambda: {s["request_id"]: s["state"] for s in engine.snapshot()["sequences"]}
                   == expected)
        seq_of = {s["request_id"]: s["seq"] for s in engine.snapshot()["sequences"]}
        for rid in ("queued", "long", "stream"):
            engine.abort(rid)
            got.wait(rid)
            assert got.last(rid).finish_reason == "abort"
        wait_until(lambda: not engine.snapshot()["sequences"])
        # The cache is freed after the scheduler forgets the sequence, on the engine thread.
        wait_until(lambda: engine.executor.num_sequences == 0)
    finally:
        engine.stop()
    aborted_from = {e["seq"]: e["from"] for e in engine.trace.events() if e["trigger"] == ABORT}
    assert aborted_from == {seq_of[rid]: state for rid, state in expected.items()}
    assert engine.admission.num_queued == 0


def test_abort_mid_prefill_stops_after_the_running_chunk(bundle, monkeypatch):
    engine, got = make_engine(bundle, "prefill_priority", max_running=1), Collector()
    chunk = hold(monkeypatch, engine.executor, "run")  # the engine thread waits in tick 1
    try:
        submit(engine, got, "big", prompt(40 * CHUNK, 4), max_tokens=4)
        chunk.wait_entered()
        assert [s["state"] for s in engine.snapshot()["sequences"]] == [PREFILLING]
        engine.abort("big")
    finally:
        chunk.open()
    try:
        got.wait("big")
        wait_until(lambda: engine.executor.num_sequences == 0)
    finally:
        engine.stop()
    assert got.last("big").finish_reason == "abort" and not got.tokens("big")
    events = engine.trace.events()
    [done] = [e for e in events if e["trigger"] == CHUNK_DONE]
    [abort] = [e for e in events if e["trigger"] == ABORT]
    assert done["to"] == PARKED, "the chunk that was running completed"
    assert (abort["from"], abort["tick"]) == (PARKED, done["tick"] + 1), "no chunk after it"
    assert not [e for e in events if e["tick"] > abort["tick"]]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_many_sequences_leave_no_memory_behind(bundle, prefix_cache):
    # With the prefix cache, what it holds is freed when it is emptied (the engine is idle).
    engine, got = make_engine(bundle, "mixed_step", max_running=8,
                              prefix_cache=prefix_cache), Collector()
    try:
        submit(engine, got, "warm", prompt(50, 0), max_tokens=5)
        got.wait("warm")
        wait_until(lambda: engine.executor.num_sequences == 0)
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()
        start = mx.get_active_memory()
        ids = [f"r{i}" for i in range(24)]
        for i, rid in enumerate(ids):
            submit(engine, got, rid, prompt(10 + 7 * i, i), max_tokens=5 + i % 7)
        got.wait(*ids)
        wait_until(lambda: engine.executor.num_sequences == 0)
        if engine.prefix_cache is not None:
            assert engine.prefix_cache.num_tokens > 0
            engine.prefix_cache.clear()
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
    engine, got = make_engine(bundle, "grant_counter", max_running=3,
                              max_kv_tokens=150), Collector()  # short: some are preempted
    try:
        for i in range(5):
            submit(engine, got, f"r{i}", prompt(20 + 30 * i, i), max_tokens=8 if i == 4 else 40)
        engine.abort("r4")
        got.wait(*(f"r{i}" for i in range(5)))
        # Two choices of one prompt on the idle engine: the second forks.
        engine.submit(GenerationRequest("r5", tuple(prompt(20, 5)), SamplingParams(), n=2),
                      got.sink)
        wait_until(lambda: sum(e.finish_reason is not None for _, e in got.events["r5"]) == 2)
    finally:
        engine.stop()
    lifecycle = load_lifecycle()
    edges = {(e.source, e.trigger.value, e.dest) for e in lifecycle.edges}
    events = [e for e in engine.trace.events() if e["kind"] == "transition"]
    fired = {e["trigger"] for e in events}
    # All but pause and resume (policies that pause: the memory-pressure test below).
    assert {e.index for _, e in got.events["r5"]} == {0, 1}
    assert fired == {t.value for t in Trigger} - {"pause", "resume"}, "each fired"
    assert all((e["from"], e["trigger"], e["to"]) in edges for e in events)


# token_budget: the poisoned prompt's first slices come in the ticks that probe the streams'
# pace (the decode rows' forward, then the slice's), so the fault is in the second forward.
@pytest.mark.parametrize("policy", ["mixed_step", "token_budget", "token_budget_lane"])
def test_a_fault_in_one_request_fails_only_that_request(bundle, policy):
    engine, got = make_engine(bundle, policy), Collector()
    poisoned = prompt(40, 5)
    real_run = engine.executor.run
    faults: list[bool] = []  # per fault: whether decode rows were in the call

    def run(prefills, decode):  # fault injection: a tick with the poisoned prompt's prefill
        if any(engine.executor.num_cached(w.seq_id) == 0 and  # its first slice
               engine.executor.prompt_left(w.seq_id) == len(poisoned) for w in prefills):
            faults.append(bool(decode))
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
    assert faults[0] is (policy == "mixed_step")  # token_budget: in a probe's own slice forward
    for rid, n in (("ok1", 30), ("ok2", 30), ("after", 5)):
        assert got.last(rid).finish_reason == "length" and len(got.tokens(rid)) == n
    assert engine.admission.num_queued == 0


def test_what_can_never_fit_is_refused_and_the_queue_is_bounded(bundle):
    from runtime.api import EngineFull

    engine, got = make_engine(bundle, "mixed_step", max_running=1, max_waiting=1,
                              max_kv_tokens=300), Collector()
    try:
        with pytest.raises(ValueError, match="must fit the KV budget of 300 tokens"):
            submit(engine, got, "huge", prompt(290, 0), max_tokens=20)
        submit(engine, got, "a", prompt(10, 1), max_tokens=280)  # runs alone for 280 ticks
        wait_until(lambda: got.tokens("a"))
        submit(engine, got, "b", prompt(10, 3), max_tokens=20)  # waits for the running place
        with pytest.raises(EngineFull, match=r"^1 request is already waiting \(--max-waiting 1\)$"):
            submit(engine, got, "c", prompt(10, 4), max_tokens=20)
        assert not got.finished("a"), "the refusal came while the place was held"
        engine.abort("a")
        got.wait("a", "b")
    finally:
        engine.stop()
    assert [got.last(r).finish_reason for r in "ab"] == ["abort", "length"]
    assert len(got.tokens("b")) == 20 and engine.admission.num_queued == 0


@pytest.mark.parametrize(("kv_full", "kinds"), [("recompute", {"drop"}),
                                                ("pause", {"pause"})])
def test_memory_pressure_loses_nothing_and_outputs_stay_exact(bundle, tmp_path, kv_full,
                                                              kinds):
    # A budget far below what the requests need together: they run anyway, some preempted
    # (and resumed, or re-prefilled from prompt + output), each with exactly the tokens of an
    # uninterrupted greedy run.
    spec = (POLICIES_DIR / "deadline.yaml").read_text().replace(
        "pick: round_robin", f"pick: round_robin\nkv_full: {kv_full}")
    policy = tmp_path / f"deadline_{kv_full}.yaml"
    policy.write_text(spec.replace("name: deadline", f"name: deadline_{kv_full}"))
    lengths = [(30, 60), (50, 40), (20, 90), (70, 30), (40, 70), (25, 50)]
    engine, got = make_engine(bundle, str(policy), max_running=8, max_kv_tokens=160), Collector()
    try:
        for i, (n, m) in enumerate(lengths):
            submit(engine, got, f"r{i}", prompt(n, 50 + i), max_tokens=m)
        got.wait(*(f"r{i}" for i in range(len(lengths))))
    finally:
        engine.stop()
    for i, (n, m) in enumerate(lengths):
        assert got.last(f"r{i}").finish_reason == "length"
        assert got.tokens(f"r{i}") == reference(bundle, prompt(n, 50 + i), m), f"r{i}"
    preempted = {k for k in ("drop", "pause")
                 if engine.metrics.preemptions.labels(k)._value.get() > 0}
    assert kinds <= preempted, "the budget was never short: not a test of preemption"
    fired = {e["trigger"] for e in engine.trace.events()}
    want = {Trigger.PREEMPT, Trigger.READMIT} if kv_full == "recompute" else \
        {Trigger.PAUSE, Trigger.RESUME}
    assert {t.value for t in want} <= fired


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
    assert engine.admission.num_queued == 0
