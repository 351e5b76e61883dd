"""Every kind of bad spec gets its own clear error naming the file, the line and the field."""

from pathlib import Path

import pytest

from statemachine.lifecycle import load_lifecycle
from statemachine.spec import load_policy, shipped_policy_names
from statemachine.yamlsrc import SpecError

GOOD_POLICY = """\
name: demo
doc: a policy
parameters:
  every:
    default: 2
    range: [1, 10]
pick: round_robin
rules:
  - {name: go, when: num_parked > 0 and decode_streak >= every, action: prefill}
  - {name: decode, when: num_decoding > 0, action: decode}
  - {name: rest, when: true, action: prefill}
claims:
  wait_ticks: every
  ttft_ticks: chunks * every
  overtakes: slots
  decode_wait_ticks: unbounded
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(loader, path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        loader(path)
    assert str(path) in str(info.value)
    return info.value


def test_the_good_policy_loads(tmp_path):
    spec = load_policy(write(tmp_path, GOOD_POLICY))
    assert spec.name == "demo" and spec.defaults == {"every": 2}
    assert spec.parameter("every").flag == "--every"
    assert spec.parameter("every").env == "FAIRTICK_EVERY"


@pytest.mark.parametrize("name", shipped_policy_names())
def test_every_shipped_policy_loads(name):
    assert load_policy(name).name == name


@pytest.mark.parametrize(("old", "new", "line", "field", "message"), [
    ("doc: a policy", "doc: [unclosed", 3, "<yaml>", "not valid YAML"),
    ("doc: a policy", "doc: a policy\ncolour: red", 3, "colour", "unknown field"),
    ("name: demo\n", "", 1, "name", "is required"),
    ("name: demo", "name: Demo Policy", 1, "name", "lower_snake_case"),
    ("default: 2", "default: 20", 5, "parameters.every.default", "outside range"),
    ("range: [1, 10]", "range: [10, 1]", 6, "parameters.every.range", "min <= max"),
    ("    range: [1, 10]", "    range: [1, 10]\n    flag: every", 7,
     "parameters.every.flag", "--some-name"),
    ("    range: [1, 10]", "    range: [1, 10]\n    env: EVERY", 7,
     "parameters.every.env", "FAIRTICK_SOME_NAME"),
    ("pick: round_robin", "pick: random", 7, "pick", "unknown pick rule"),
    ("action: decode}", "action: sleep}", 10, "rules.1.action", "must be one of"),
    ("when: num_decoding > 0", "when: num_decoders > 0", 10, "rules.1.when",
     "unknown name 'num_decoders'"),
    ("when: num_decoding > 0", "when: num_decoding + 1", 10, "rules.1.when",
     "expected a condition"),
    ("name: decode,", "name: go,", 10, "rules.1.name", "duplicate rule name"),
    ("  overtakes: slots\n", "", 13, "claims.overtakes", "is required"),
    ("wait_ticks: every", "wait_ticks: every > 1", 13, "claims.wait_ticks",
     "expected a number"),
    ("ttft_ticks: chunks * every", "ttft_ticks: chunks * evrey", 14, "claims.ttft_ticks",
     "unknown name 'evrey'"),
])
def test_policy_errors(tmp_path, old, new, line, field, message):
    assert old in GOOD_POLICY
    err = error_of(load_policy, write(tmp_path, GOOD_POLICY.replace(old, new, 1)))
    assert (err.line, err.field) == (line, field)
    assert message in err.message


def test_missing_policy_file_lists_the_shipped_ones():
    with pytest.raises(SpecError, match="shipped: .*deadline"):
        load_policy("no_such_policy")


GOOD_LIFECYCLE = """\
initial: waiting
terminal: [finished, aborted]
slot_states: [parked_prefill, prefilling, decoding]
states:
  waiting: queued
  parked_prefill: parked
  prefilling: running a chunk
  decoding: decoding
  finished: done
  aborted: cancelled
guards:
  has_prefill_left: prompt left
transitions:
  - {trigger: admit, source: waiting, dest: parked_prefill}
  - {trigger: grant, source: parked_prefill, dest: prefilling}
  - {trigger: chunk_done, source: prefilling, dest: parked_prefill, conditions: [has_prefill_left]}
  - {trigger: chunk_done, source: prefilling, dest: decoding, unless: [has_prefill_left]}
  - {trigger: finish, source: decoding, dest: finished}
  - {trigger: abort, source: [waiting, parked_prefill, prefilling, decoding], dest: aborted}
"""


def test_a_state_without_exit_is_rejected(tmp_path):
    text = GOOD_LIFECYCLE.replace("  aborted: cancelled\n", "  aborted: cancelled\n  stuck: x\n")
    text += "  - {trigger: hold, source: waiting, dest: stuck}\n"
    err = error_of(load_lifecycle, write(tmp_path, text))
    assert (err.line, err.field) == (11, "states.stuck")
    assert "no transition leaves it" in err.message


def test_the_good_lifecycle_loads(tmp_path):
    life = load_lifecycle(write(tmp_path, GOOD_LIFECYCLE))
    assert life.terminal == {"finished", "aborted"}


@pytest.mark.parametrize(("old", "new", "line", "field", "message"), [
    ("dest: finished}", "dest: done}", 18, "transitions.4.dest", "unknown state 'done'"),
    ("  aborted: cancelled", "  aborted: cancelled\n  limbo: never entered", 11, "states.limbo",
     "unreachable"),
    ("guards:\n  has_prefill_left: prompt left", "guards:\n  has_prefill_left: prompt left\n"
     "  is_lucky: unbound", 13, "guards.is_lucky", "cannot bind guard 'is_lucky'"),
    ("conditions: [has_prefill_left]", "conditions: [is_long]", 16,
     "transitions.2.conditions", "'is_long' is not declared"),
    (", unless: [has_prefill_left]", "", 17, "transitions.3", "declared twice"),
    ("initial: waiting", "initial: queued", 1, "initial", "unknown state 'queued'"),
])
def test_lifecycle_errors(tmp_path, old, new, line, field, message):
    assert old in GOOD_LIFECYCLE
    err = error_of(load_lifecycle, write(tmp_path, GOOD_LIFECYCLE.replace(old, new, 1)))
    assert (err.line, err.field) == (line, field)
    assert message in err.message
