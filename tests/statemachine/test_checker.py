"""The exhaustive checker accepts the shipped policies and catches planted bugs."""

import io

import pytest

from statemachine.checker import Checker
from statemachine.checker_cli import main as check_main
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy

NON_BASELINE = [n for n in shipped_policy_names() if n != "baseline"]
SMALL = {"max_seqs": 3, "max_chunks": 3, "slots": 3}
# Parameters small enough for the exhaustive search to stay quick in the test suite.
QUICK = {"deadline": {"max_wait": 2}, "grant_counter": {"interval": 2}}


def check(spec, overrides=None, **bounds):
    checker = Checker(make_policy(str(spec), overrides), **{**SMALL, **bounds})
    return checker, checker.run(time_limit_s=120)


@pytest.mark.parametrize("name", NON_BASELINE)
def test_shipped_policies_keep_every_claim(name):
    _, report = check(name, QUICK.get(name))
    assert report.ok, report.counterexamples
    assert report.states > 200  # the search really explored


@pytest.mark.parametrize("name", NON_BASELINE)
def test_the_wait_claim_is_tight(name):
    """The bound each policy claims is reached (a claim one smaller would be false)."""
    checker, report = check(name, QUICK.get(name))
    assert report.max_seen["wait_ticks"] == checker.bounds.wait_ticks


def test_baseline_starves_a_parked_prompt():
    checker, report = check("baseline", max_seqs=2, max_chunks=2, slots=2)
    violation, path = report.counterexamples["no_starvation"]
    steps = checker.replay(path)
    assert [text for text, _ in steps][-1].startswith("tick")
    assert checker.lasso(path, violation.seq) is not None
    granted = {e["seq"] for _, events in steps for e in events if e["trigger"] == "grant"}
    assert violation.seq not in granted


@pytest.mark.parametrize(("base", "claim"), [
    ("deadline", "wait_ticks"), ("grant_counter", "wait_ticks"), ("mixed_step", "overtakes"),
    ("prefill_priority", "wait_ticks"),
])
def test_a_claim_one_smaller_than_the_truth_is_caught(variant, base, claim):
    shipped = make_policy(base).spec.claims[claim]
    path = variant(base, claims={claim: f"{shipped.source} - 1"})
    _, report = check(path, QUICK.get(base))
    violation, labels = report.counterexamples[claim]
    assert "claimed" in violation.message and labels[-1] == ("tick", 0)


def test_a_pick_rule_that_lets_a_prompt_be_overtaken_is_caught(variant):
    # Shortest-remaining-first: short prompts keep arriving and overtake a long one.
    path = variant("mixed_step", pick="fewest_left")
    _, report = check(path)
    assert {"overtakes", "wait_ticks"} <= set(report.counterexamples)


def test_a_decode_bound_that_cannot_be_kept_is_caught(variant):
    path = variant("prefill_priority", claims={"decode_wait_ticks": "slots"})
    _, report = check(path)
    assert "decode_wait_ticks" in report.counterexamples


def test_a_policy_that_idles_with_work_is_caught(variant):
    path = variant("mixed_step", rules=[
        {"name": "mixed", "when": "num_parked > 0 and num_decoding > 0", "action": "mixed"},
        {"name": "idle", "when": "true", "action": "idle"}])
    _, report = check(path)
    assert "no_idle_with_work" in report.counterexamples


def test_a_ttft_claim_that_does_not_follow_is_checked_exactly(variant):
    path = variant("prefill_priority", claims={"ttft_ticks": "slots * chunks - 1"})
    checker, report = check(path)
    assert not checker.ttft_implied
    assert "ttft_ticks" in report.counterexamples


def test_cli_exit_codes_and_output(variant, tmp_path):
    out = io.StringIO()
    assert check_main(["mixed_step", "--max-seqs", "2", "--max-chunks", "2", "--slots", "2"],
                      out) == 0
    assert "wait_ticks" in out.getvalue() and "VIOLATED" not in out.getvalue()
    out = io.StringIO()
    assert check_main(["baseline", "--max-seqs", "2", "--max-chunks", "2", "--slots", "2",
                       "--horizon", "6"], out) == 1
    text = out.getvalue()
    assert "counterexample for no_starvation" in text and '"trigger":"admit"' in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert check_main([str(bad)]) == 2
    assert check_main(["deadline", "--set", "max_wait=0"]) == 2
    assert check_main(["deadline", "--set", "nope=1"]) == 2
