"""The exhaustive checker proves what the scheduler runs: the shipped policies at their served
defaults, planted bugs caught (one for each abstraction), and the reductions exact."""

import io

import pytest

from statemachine.abstraction import CannotCheck
from statemachine.checker import Checker, CheckLayout
from statemachine.checker_cli import main as check_main
from statemachine.counterexample import replay
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy
from statemachine.world import World

NON_BASELINE = [n for n in shipped_policy_names() if n != "baseline"]
# Small enough for the test suite; docs/benchmark_results has the 5/4/4 and memory layouts.
STREAMS = CheckLayout(max_seqs=4, max_chunks=3, max_running=3)
MEMORY = CheckLayout(max_seqs=3, max_chunks=2, max_running=2, max_tokens=2, kv_budget=4)
QUICK = {"deadline": {"max_wait": 2}, "grant_counter": {"interval": 2}}


def check(spec, overrides=None, layout=STREAMS):
    checker = Checker(make_policy(str(spec), overrides), layout)
    return checker, checker.run(time_limit_s=300)


@pytest.mark.parametrize("layout", [STREAMS, MEMORY], ids=["streams", "memory"])
@pytest.mark.parametrize("name", NON_BASELINE)
def test_shipped_policies_keep_every_claim_at_their_served_defaults(name, layout):
    checker, report = check(name, layout=layout)
    assert report.ok, {k: v[0] for k, v in report.counterexamples.items()}
    assert report.states > 100  # the search really explored


@pytest.mark.parametrize("name", NON_BASELINE)
def test_the_wait_claim_is_tight(name):
    """The bound each policy claims is reached (a claim one smaller would be false)."""
    checker, report = check(name, QUICK.get(name))
    assert report.max_seen["wait_ticks"] == checker.bounds(1).wait_ticks


def test_the_memory_layout_queues_and_preempts():
    """The arrival claims are checked where arrivals really wait and sequences are preempted."""
    _, report = check("mixed_step", layout=MEMORY)
    assert report.ok
    assert report.max_seen["queue_ticks"] >= 2 and report.max_seen["preemptions"] >= 1
    assert report.bounds.queue_ticks is not None and report.bounds.preemptions is not None


@pytest.mark.parametrize("name", ["mixed_step", "token_budget", "deadline"])
def test_the_queue_wait_as_a_longest_path_is_the_wait_tracked_in_the_keys(name):
    policy = make_policy(name, QUICK.get(name))
    paths, keyed = Checker(policy, MEMORY), Checker(policy, MEMORY, queue_paths=False)
    assert paths.queue_paths and not keyed.queue_paths
    by_paths, by_keys = paths.run(), keyed.run()
    assert by_paths.max_seen == by_keys.max_seen
    assert by_paths.max_seen["queue_ticks"] >= 2
    assert by_paths.ok and by_keys.ok
    assert by_paths.states < by_keys.states  # keys without the wait: fewer states


def test_a_queue_claim_one_smaller_than_the_truth_is_caught(variant):
    truth = Checker(make_policy("mixed_step"), MEMORY, queue_paths=False).run() \
        .max_seen["queue_ticks"]
    path = variant("mixed_step", claims={"queue_ticks": str(truth - 1)})
    checker, report = check(path, layout=MEMORY)
    assert checker.queue_paths
    violation, labels, chunk = report.counterexamples["queue_ticks"]
    run = replay(checker, labels, chunk)  # the Scheduler itself breaks it
    assert "queue_ticks" in {v.name for v in run.violations}


def test_the_streams_layout_leaves_the_arrival_claims_unbounded():
    _, report = check("deadline")
    assert report.bounds.queue_ticks is None and report.bounds.ttft(3) is None
    assert report.bounds.wait_ticks is not None


def test_baseline_starves_a_parked_prompt_forever():
    checker, report = check("baseline", layout=CheckLayout(3, 2, 2))
    violation, path, chunk = report.counterexamples["no_starvation"]
    run = replay(checker, path, chunk)
    assert run.violations[0].name == "no_starvation"
    assert run.lasso is not None  # a cycle the policy can repeat forever
    granted = {e["seq"] for e in run.events if e["trigger"] == "grant"}
    assert run.violations[0].seq not in granted
    assert report.max_seen["wait_ticks"] >= checker.horizon  # the wait that counts as starving


@pytest.mark.parametrize(("base", "claim"), [
    ("deadline", "wait_ticks"), ("grant_counter", "wait_ticks"), ("mixed_step", "wait_ticks"),
    ("prefill_priority", "wait_ticks"), ("mixed_step", "overtakes"),
    ("token_budget", "overtakes"),
])
def test_a_claim_one_smaller_than_the_truth_is_caught(variant, base, claim):
    shipped = make_policy(base).spec.claims[claim]
    path = variant(base, claims={claim: f"{shipped.source} - 1"})
    checker, report = check(path, QUICK.get(base))
    violation, labels, chunk = report.counterexamples[claim]
    run = replay(checker, labels, chunk)  # the Scheduler itself breaks it, with stable ids
    assert claim in {v.name for v in run.violations}
    assert labels[-1][0] == "tick"
    # The table's "max seen" is at least the counterexample's value, past the claim.
    assert report.max_seen[claim] > getattr(checker.bounds(chunk), claim)


def test_a_ttft_claim_that_does_not_follow_is_tracked_exactly(variant):
    # Forgets the time spent queued for KV room: false in the memory layout.
    path = variant("mixed_step", claims={"ttft_ticks": "chunks * (wait_ticks + 1)"})
    checker, report = check(path, layout=MEMORY)
    assert checker.abs.age_cap > 0  # ages are tracked for the observed sequence
    assert "ttft_ticks" in report.counterexamples


# -- planted bugs, one per abstraction: each was a false proof or a blind spot -------------

def test_a_rule_past_an_unbounded_counter_fires(variant):
    # prefill_priority claims no bound on decode waits; a rule that naps once decoding has
    # waited 20 ticks never fired under the old cap (10): the nap must be found.
    path = variant("prefill_priority", rules=[
        {"name": "nap", "when": "num_decoding > 0 and decode_wait_ticks >= 20",
         "action": "idle"},
        *[{"name": r.name, "when": r.when.source, "action": r.action}
          for r in make_policy("prefill_priority").spec.rules]])
    checker, report = check(path, layout=CheckLayout(3, 2, 2))
    assert checker.abs.dwait_cap == 21
    assert "no_idle_with_work" in report.counterexamples


def test_a_rule_on_the_decode_streak_fires(variant):
    path = variant("grant_counter", rules=[
        {"name": "doze", "when": "decode_streak >= 12", "action": "idle"},
        *[{"name": r.name, "when": r.when.source, "action": r.action}
          for r in make_policy("grant_counter").spec.rules]],
        parameters={"interval": {"default": 30, "range": [1, 100]}},
        claims={"wait_ticks": "unbounded"})
    checker, report = check(path, layout=CheckLayout(3, 2, 2))
    assert "no_idle_with_work" in report.counterexamples


def test_a_budget_gate_is_explored_below_the_chunk(variant):
    # Skip the slice when the budget is under a chunk: normal in the engine, so prompts starve.
    path = variant("token_budget", rules=[
        {"name": "mixed_slice", "when": "num_parked > 0 and num_decoding > 0 and "
         "budget_tokens >= chunk_size", "action": "mixed"},
        {"name": "decode", "when": "num_decoding > 0", "action": "decode"},
        {"name": "prefill_alone", "when": "num_parked > 0", "action": "prefill"},
        {"name": "idle", "when": "true", "action": "idle"}])
    checker, report = check(path, layout=CheckLayout(3, 2, 2))
    assert len(checker.abs.chunk_sizes) > 1 and checker.abs.budgets
    assert "wait_ticks" in report.counterexamples


def test_a_rule_that_idles_while_requests_wait_is_caught(variant):
    rules = [{"name": "hold", "when": "num_waiting > 0", "action": "idle"},
             *[{"name": r.name, "when": r.when.source, "action": r.action}
               for r in make_policy("mixed_step").spec.rules]]
    _, report = check(variant("mixed_step", rules=rules))  # 4 sequences, 3 running
    assert "no_idle_with_work" in report.counterexamples
    with pytest.raises(CannotCheck, match="num_waiting"):  # no queue: refuses, never passes
        Checker(make_policy(str(variant("mixed_step", rules=rules))), CheckLayout(3, 2, 3))


def test_a_count_compared_past_the_layout_is_refused(variant):
    path = variant("mixed_step", rules=[{"name": "crowd", "when": "num_parked >= 9",
                                         "action": "prefill"},
                                        {"name": "idle", "when": "true", "action": "idle"}])
    with pytest.raises(CannotCheck, match="num_parked with 9.*reach 10"):
        Checker(make_policy(str(path)), STREAMS)


def test_a_counter_outside_a_plain_comparison_is_refused(variant):
    path = variant("deadline", rules=[
        {"name": "due", "when": "max_wait_ticks * 2 >= max_wait", "action": "prefill"},
        {"name": "idle", "when": "true", "action": "idle"}])
    with pytest.raises(CannotCheck, match="max_wait_ticks"):
        Checker(make_policy(str(path)), STREAMS)


def test_a_pick_rule_that_reads_progress_is_checked_with_exact_progress(variant):
    # Shortest-remaining-first: short prompts keep arriving and overtake a long one.
    checker, report = check(variant("mixed_step", pick="fewest_left"))
    assert checker.abs.progress
    assert {"overtakes", "wait_ticks"} <= set(report.counterexamples)


# -- the reductions are exact ------------------------------------------------------------------

def quotient(reduced: Checker, naive: Checker) -> set:
    """Every reduced state the naive states stand for: one per choice of observed sequence."""
    keys = set()
    for chunk in naive.abs.chunk_sizes:
        layout, report = naive.run_layout(chunk), naive.run()  # a sink for observations
        root = naive.key(World())
        seen, frontier = {root}, [root]
        while frontier:
            key = frontier.pop()
            world = naive.decode(key)
            for i in [None, *(range(len(world.seqs)) if reduced.tracks_observed else [])]:
                marked = world._replace(seqs=tuple(s._replace(observed=(j == i))
                                                   for j, s in enumerate(world.seqs)))
                keys.add((chunk, reduced.key(marked)))
            for _, nkey, violations, _ in naive._successors(key, chunk, layout, report):
                assert not violations
                if nkey not in seen:
                    seen.add(nkey)
                    frontier.append(nkey)
    return keys


@pytest.mark.parametrize("layout", [CheckLayout(3, 2, 2),
                                    CheckLayout(3, 2, 2, max_tokens=2, kv_budget=4)],
                         ids=["streams", "memory"])
@pytest.mark.parametrize("name", ["deadline", "grant_counter", "mixed_step"])
def test_the_reduced_state_count_is_the_naive_one_quotiented(name, layout):
    policy = make_policy(name, QUICK.get(name))
    reduced, naive = Checker(policy, layout), Checker(policy, layout, reduce=False)
    report = reduced.run()
    assert report.ok
    assert len(quotient(reduced, naive)) == report.states


def test_replayed_counterexamples_use_the_traces_stable_ids(variant):
    # After an abort the checker renumbers; the printed messages must not.
    path = variant("mixed_step", claims={"wait_ticks": "max(0, max_running - 2)"})
    out = io.StringIO()
    assert check_main([str(path), "--layout", "streams", "--max-seqs", "4",
                       "--max-chunks", "2", "--max-running", "3"], out) == 1
    text = out.getvalue()
    head = text[text.index("-- counterexample for wait_ticks"):]
    seq = int(head.split("seq ")[1].split()[0])
    assert f'"seq":{seq}' in head  # the trace shows the same sequence the message names


def test_cli_exit_codes_and_output(tmp_path):
    out = io.StringIO()
    assert check_main(["mixed_step", "--max-seqs", "3", "--max-chunks", "2",
                       "--max-running", "2"], out) == 0
    text = out.getvalue()
    assert "streams layout" in text and "memory layout" in text and "VIOLATED" not in text
    out = io.StringIO()
    assert check_main(["baseline", "--max-seqs", "3", "--max-chunks", "2", "--max-running",
                       "2", "--layout", "streams", "--horizon", "6"], out) == 1
    text = out.getvalue()
    assert "counterexample for no_starvation" in text and '"trigger":"admit"' in text
    assert "can repeat forever" in text
    # --stateful: the Hypothesis run once per policy, after the exhaustive check of each layout.
    out = io.StringIO()
    assert check_main(["mixed_step", "--max-seqs", "3", "--max-chunks", "2", "--max-running",
                       "2", "--stateful", "--examples", "5"], out) == 0
    text = out.getvalue()
    assert "streams layout" in text and "memory layout" in text
    assert text.count("== mixed_step: stateful: all claims hold (5 examples)") == 1, text
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert check_main([str(bad)]) == 2
    assert check_main(["deadline", "--set", "max_wait=0"]) == 2
    assert check_main(["deadline", "--set", "nope=1"]) == 2
    assert check_main(["deadline", "--max-seqs", "0"]) == 2


@pytest.mark.parametrize(("flags", "message"), [
    (["--horizon", "0"], "argument --horizon: must be >= 1, got 0"),
    (["--stateful", "--examples", "-5"], "argument --examples: must be >= 1, got -5"),
    (["--examples", "0"], "argument --examples: must be >= 1, got 0"),
    (["--time-limit", "-1"], "argument --time-limit: must be a finite number of seconds > 0"),
    (["--time-limit", "inf"], "argument --time-limit: must be a finite number of seconds > 0"),
])
def test_cli_refuses_bounds_that_mean_nothing_before_any_search(flags, message, capsys):
    # Each was taken and failed later: a traceback after the whole search, a misleading
    # "lower the bounds", or silently nothing.
    with pytest.raises(SystemExit) as exit_info:
        check_main(["deadline", *flags], io.StringIO())
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_claim_below_0_at_the_checked_values_is_an_error_naming_them(variant, capsys):
    # `max_wait - 30` loads (max_wait may reach 1024) but is -6 at the default 24: it was
    # reported VIOLATED, as if the policy broke a bound.
    path = variant("deadline", claims={"wait_ticks": "max_wait - 30"})
    assert check_main([str(path), "--layout", "streams", "--max-seqs", "2"], io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "claim wait_ticks: 'max_wait - 30' is -6 at max_wait=24; a bound must be >= 0" in err
