"""specs/lifecycle.yaml is the one vocabulary: states are names for roles the code handles."""

import io
from pathlib import Path

import pytest
import yaml

from server.cli import main as cli_main
from statemachine.checker import Checker, CheckLayout
from statemachine.lifecycle import DEFAULT_LIFECYCLE, Role, Trigger, load_lifecycle
from statemachine.scheduler import Scheduler
from statemachine.spec import shipped_policy_names
from statemachine.tick import make_policy
from statemachine.world import Layout
from statemachine.yamlsrc import SpecError

SHIPPED = yaml.safe_load(DEFAULT_LIFECYCLE.read_text())


def write(tmp_path: Path, doc: dict, name: str = "life.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def renamed(doc: dict, rename) -> dict:
    """The lifecycle with every state renamed by `rename`."""
    def one(x):
        return [rename(s) for s in x] if isinstance(x, list) else rename(x)

    return {**doc, "states": {rename(k): v for k, v in doc["states"].items()},
            "transitions": [{**t, "source": one(t["source"]), "dest": one(t["dest"])}
                            for t in doc["transitions"]]}


def error_of(doc_or_text, tmp_path: Path) -> SpecError:
    path = tmp_path / "bad.yaml"
    path.write_text(doc_or_text if isinstance(doc_or_text, str)
                    else yaml.safe_dump(doc_or_text, sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_lifecycle(path)
    return info.value


def test_every_role_has_one_state_and_the_machine_compiles():
    life = load_lifecycle()
    assert set(life.state_of) == set(Role)
    assert {life.role_of[s] for s in life.state_of.values()} == set(Role)
    machine = life.make_machine()
    assert set(machine.states) == set(life.role_of)
    assert {e.trigger for e in life.edges} == set(Trigger)


@pytest.mark.parametrize("layout", [CheckLayout(3, 2, 2),
                                    CheckLayout(3, 2, 2, max_tokens=2, kv_budget=4)],
                         ids=["streams", "memory"])
def test_a_renamed_lifecycle_checks_identically(tmp_path, layout):
    path = write(tmp_path, renamed(SHIPPED, lambda s: f"phase_{s[::-1]}"))
    other = load_lifecycle(path)
    assert other.state_of[Role.DECODING] == "phase_gnidoced"
    for name in shipped_policy_names():
        policy = make_policy(name)
        a = Checker(policy, layout).run()
        b = Checker(policy, layout, other).run()
        assert (a.states, a.edges, sorted(a.counterexamples), a.max_seen) == \
            (b.states, b.edges, sorted(b.counterexamples), b.max_seen), name


def test_a_renamed_lifecycle_schedules_identically_and_traces_its_names(tmp_path):
    other = load_lifecycle(write(tmp_path, renamed(SHIPPED, lambda s: s.upper().lower() + "_z")))
    runs = []
    for life in (load_lifecycle(), other):
        sched = Scheduler(make_policy("deadline"), Layout(4, 4, 30), life, check=True)
        for seq in range(4):
            sched.submit(seq, 9, 12)
        plans = []
        for _ in range(40):
            plan = sched.schedule()
            plans.append((plan.decision, plan.prefills, plan.decode))
            sched.complete(plan)
        runs.append((plans, [(e["seq"], e["trigger"], life.role_of[e["to"]])
                             for e in sched.trace.events()]))
        assert {e["to"] for e in sched.trace.events()} <= set(life.role_of)
    assert runs[0] == runs[1]
    assert any(role is Role.PREEMPTED for _, _, role in runs[0][1])  # the budget preempted


def test_check_and_serve_take_a_lifecycle_file(tmp_path, capsys):
    path = write(tmp_path, renamed(SHIPPED, lambda s: s + "_x"))
    assert cli_main(["check", "mixed_step", "--lifecycle", str(path), "--max-seqs", "2",
                     "--max-chunks", "2", "--max-running", "2", "--layout", "streams"]) == 0
    assert "wait_ticks" in capsys.readouterr().out
    bad = write(tmp_path, {**SHIPPED, "states": {**SHIPPED["states"],
                                                 "waiting": {"role": "lobby"}}}, "bad.yaml")
    assert cli_main(["check", "mixed_step", "--lifecycle", str(bad)]) == 2
    assert "no code handles role 'lobby'" in capsys.readouterr().err
    assert cli_main(["serve", "--lifecycle", str(bad)]) == 2
    assert "no code handles role 'lobby'" in capsys.readouterr().err


def test_an_unknown_role_is_refused_with_the_roles_the_code_handles(tmp_path):
    doc = {**SHIPPED, "states": {**SHIPPED["states"], "limbo": {"role": "purgatory"}}}
    err = error_of(doc, tmp_path)
    assert err.field == "states.limbo.role"
    assert "no code handles role 'purgatory'" in err.message and "preempted" in err.message


def test_a_role_named_twice_or_not_at_all_is_refused(tmp_path):
    doc = {**SHIPPED, "states": {**SHIPPED["states"], "also_waiting": {"role": "queued"}}}
    assert "already the role of state 'waiting'" in error_of(doc, tmp_path).message
    states = {k: v for k, v in SHIPPED["states"].items() if v["role"] != "prefilling"}
    doc = {**SHIPPED, "states": states}
    assert "no state has role prefilling" in error_of(doc, tmp_path).message


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: [*t, {"trigger": "admit", "source": "waiting", "dest": "decoding"}],
     "is not an edge the code fires"),
    (lambda t: [x for x in t if x["trigger"] != "readmit"], "missing 'readmit' from"),
    (lambda t: [*t, {"trigger": "teleport", "source": "waiting", "dest": "decoding"}],
     "no code fires trigger 'teleport'"),
    (lambda t: [{**x, "conditions": []} if x.get("conditions") else x for x in t],
     "must have conditions ['has_prefill_left']"),
    (lambda t: [*t, dict(t[0])], "declared twice"),
])
def test_edges_must_be_exactly_the_ones_the_code_fires(tmp_path, change, message):
    doc = {**SHIPPED, "transitions": change(list(SHIPPED["transitions"]))}
    assert message in error_of(doc, tmp_path).message


def test_a_guard_no_code_evaluates_is_refused(tmp_path):
    doc = {**SHIPPED, "guards": {**SHIPPED["guards"], "is_lucky": "never"}}
    err = error_of(doc, tmp_path)
    assert err.field == "guards.is_lucky" and "no code evaluates guard" in err.message


def test_without_preemption_states_a_kv_budget_is_refused_clearly(tmp_path):
    keep = {k: v for k, v in SHIPPED["states"].items()
            if v["role"] not in ("paused", "preempted")}
    gone = set(SHIPPED["states"]) - set(keep)
    trans = []
    for t in SHIPPED["transitions"]:
        src = t["source"] if isinstance(t["source"], list) else [t["source"]]
        src = [s for s in src if s not in gone]
        if src and t["dest"] not in gone:
            trans.append({**t, "source": src})
    life = load_lifecycle(write(tmp_path, {**SHIPPED, "states": keep, "transitions": trans}))
    Scheduler(make_policy("deadline"), Layout(4, 8), life)  # no budget: nothing to preempt
    with pytest.raises(ValueError, match="kv_full: recompute .* needs a state with role "
                                         "preempted"):
        Scheduler(make_policy("deadline"), Layout(4, 8, 100), life)


def test_a_lifecycle_gets_the_yaml_limits(tmp_path):
    text = DEFAULT_LIFECYCLE.read_text().replace("  waiting:\n", "  waiting: &w\n", 1)
    err = error_of(text, tmp_path)
    assert "anchors and aliases are not supported" in err.message


def test_the_cli_reports_a_lifecycle_error_on_stderr(tmp_path):
    out = io.StringIO()
    bad = tmp_path / "x.yaml"
    bad.write_text("states: []\n")
    from statemachine.checker_cli import main as check_main

    assert check_main(["mixed_step", "--lifecycle", str(bad)], out) == 2
    assert out.getvalue() == ""
