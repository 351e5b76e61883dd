"""Every kind of bad spec gets its own clear error naming the file, the line and the field."""

from pathlib import Path

import pytest

from server.cli import main as cli_main
from statemachine.spec import load_policy, shipped_policy_names
from statemachine.yamlsrc import MAX_BYTES, MAX_VALUES, SpecError, load_source

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
  overtakes: max_running
  decode_wait_ticks: unbounded
  preemptions: max_seqs * max_tokens
  queue_ticks: unbounded
  ttft_ticks: chunks * every
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
    ("  overtakes: max_running\n", "", 13, "claims.overtakes", "is required"),
    ("wait_ticks: every", "wait_ticks: every > 1", 13, "claims.wait_ticks",
     "expected a number"),
    ("ttft_ticks: chunks * every", "ttft_ticks: chunks * evrey", 18, "claims.ttft_ticks",
     "unknown name 'evrey'"),
    # A bound below 0 was reported VIOLATED, -2 grants ran as 1: both refused at load, over
    # every value the names may take (`every` ranges over [1, 10]).
    ("queue_ticks: unbounded", "queue_ticks: -1", 17, "claims.queue_ticks",
     "must be at least 0 (a bound counts ticks or preemptions); '-1' ranges over [-1, -1]"),
    ("wait_ticks: every", "wait_ticks: every - 11", 13, "claims.wait_ticks",
     "'every - 11' ranges over [-10, -1]"),
    ("pick: round_robin", "pick: round_robin\ngrants: -2", 8, "grants",
     "must be at least 1 (a tick grants at least one prompt); '-2' ranges over [-2, -2]"),
    ("pick: round_robin", "pick: round_robin\ngrants: 0 - num_parked", 8, "grants",
     "'0 - num_parked' ranges over [-inf, 0]"),
])
def test_policy_errors(tmp_path, old, new, line, field, message):
    assert old in GOOD_POLICY
    err = error_of(load_policy, write(tmp_path, GOOD_POLICY.replace(old, new, 1)))
    assert (err.line, err.field) == (line, field)
    assert message in err.message


def test_missing_policy_file_lists_the_shipped_ones():
    with pytest.raises(SpecError, match="shipped: .*deadline"):
        load_policy("no_such_policy")


# -- malformed at any depth or size: exit 2 with file, line, field and a short excerpt --------

RULE_WHEN = "when: num_parked > 0 and decode_streak >= every"  # rules.0.when, line 9
BOMB = 'lol: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 10))


def when(expression: str) -> str:
    return GOOD_POLICY.replace(RULE_WHEN, f"when: {expression}")


# (spec text, line, field, what the message says, the excerpt it quotes)
MALFORMED = {
    "3000 nested not": (when("not " * 3000 + "true"), 9, "rules.0.when",
                        "is 12004 characters long; an expression may have at most 1000",
                        "'not not not not not not not not not not not not not not not …'"),
    "2000-term sum": (when(" + ".join(["1"] * 2000) + " > 0"), 9, "rules.0.when",
                      "is 8001 characters long", "'" + "1 + " * 15 + "…'"),
    "2000 nested parens": (when("(" * 2000 + "true" + ")" * 2000), 9, "rules.0.when",
                           "characters long", "'" + "(" * 60 + "…'"),
    "240 nested not": (when("not " * 240 + "true"), 9, "rules.0.when",
                       "nests more than 32 levels deep", "'not not not"),
    "5000 nested lists": (GOOD_POLICY.replace("doc: a policy", "doc: " + "[" * 5000 + "]" * 5000),
                          2, "doc.0.0.0.0", "nested deeper than 32 levels",
                          "near 'doc: " + "[" * 55 + "…'"),
    "60000 values": (GOOD_POLICY.replace("doc: a policy", "doc: [" + "1," * 60000 + "]"), 2,
                     "doc.", "more than 2000 values", "near 'doc: [1,1,1,"),
    "alias bomb": (BOMB, 1, "lol", "anchor &a0: anchors and aliases are not supported",
                   "near 'lol: &a0 [\"lol\""),
    "an alias to its own value": (GOOD_POLICY.replace("doc: a policy", "doc: &d [*d]"), 2, "doc",
                                  "anchor &d", "near 'doc: &d [*d]'"),
    "a reused condition": (GOOD_POLICY.replace("when: num_decoding > 0", "when: *w").replace(
        RULE_WHEN, f"when: &w {RULE_WHEN[6:]}"), 9, "rules.0.when", "anchor &w", "near"),
    "10 // num_parked": (when("10 // num_parked > 1"), 9, "rules.0.when",
                         "'num_parked' can be 0 (it ranges over [0, inf])",
                         "'10 // num_parked' could divide by zero; divide by something that "
                         "cannot be 0, e.g. max(1, num_parked)"),
    "a divisor parameter with 0 in range": (
        GOOD_POLICY.replace("range: [1, 10]", "range: [0, 10]").replace(
            "overtakes: max_running", "overtakes: max_running // every"), 14, "claims.overtakes",
        "'every' can be 0 (it ranges over [0, 10])", "max(1, every)"),
    "a merge key": (GOOD_POLICY.replace("doc: a policy", "doc: a policy\nx: {<<: {a: 1}}"), 3,
                    "x", "merge keys (<<) are not supported", ""),
    "an unknown tag": (GOOD_POLICY.replace("pick: round_robin",
                                           "pick: !!python/name:os.system round_robin"), 7,
                       "pick", "could not determine a constructor", "'round_robin'"),
    "a bad !!int": (GOOD_POLICY.replace("default: 2", "default: !!int two"), 5,
                    "parameters.every.default", "cannot read 'two'", "invalid literal"),
    "a 5000-digit number": (GOOD_POLICY.replace("default: 2", "default: " + "9" * 5000), 5,
                            "parameters.every.default", "Exceeds the limit (4300 digits)",
                            "'" + "9" * 60 + "…'"),
}


@pytest.fixture(params=sorted(MALFORMED))
def malformed(request, tmp_path):
    text, line, field, message, quoted = MALFORMED[request.param]
    return write(tmp_path, text), line, field, message, quoted


def test_a_malformed_spec_is_a_spec_error_naming_line_field_and_excerpt(malformed):
    path, line, field, message, quoted = malformed
    err = error_of(load_policy, path)
    assert err.line == line and err.field.startswith(field)
    assert message in err.message and quoted in err.message
    assert len(str(err)) < 400  # an excerpt, never the whole value


def test_fairtick_check_exits_2_on_a_malformed_spec(malformed, capsys):
    path, line, field, message, _ = malformed
    assert cli_main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{path}:{line}: {field}" in captured.err and message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_fairtick_serve_refuses_a_malformed_spec(malformed, capsys):
    path, line, field, message, _ = malformed
    assert cli_main(["serve", "--policy", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"invalid policy spec: {path}:{line}: {field}" in err and message in err


def test_legitimate_divisions_load(tmp_path):
    text = GOOD_POLICY.replace("pick: round_robin", "pick: round_robin\n"
                               "chunk_tokens: chunk_size // max(1, num_parked)\n"
                               "grants: max(1, max_running // 2)")
    text = text.replace(RULE_WHEN, "when: decode_streak >= 10 // every + chunk_size // max_running"
                        " + num_waiting // (num_parked + 1)")
    text = text.replace("overtakes: max_running",
                        "overtakes: (2 * max_running) // (max_running * chunks)")
    spec = load_policy(write(tmp_path, text))
    assert spec.chunk_tokens({"chunk_size": 8, "num_parked": 0}) == 8
    assert spec.chunk_tokens({"chunk_size": 8, "num_parked": 3}) == 2
    assert spec.grants({"max_running": 1}) == 1
    env = {"decode_streak": 5, "every": 2, "chunk_size": 4, "max_running": 4, "num_waiting": 3,
           "num_parked": 0}
    assert spec.rules[0].when(env) is False  # 5 >= 5 + 1 + 3 is false
    assert spec.claims["overtakes"]({"max_running": 3, "chunks": 1, "every": 2}) == 2


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path):
    padding = "#" * 79 + "\n"
    at_limit = GOOD_POLICY + padding * ((MAX_BYTES - len(GOOD_POLICY)) // len(padding))
    at_limit += "#" * (MAX_BYTES - len(at_limit) - 1) + "\n"
    assert len(at_limit.encode()) == MAX_BYTES
    assert load_policy(write(tmp_path, at_limit)).name == "demo"
    err = error_of(load_policy, write(tmp_path, at_limit + "\n", "big.yaml"))
    assert (err.line, err.field) == (None, "<file>")
    assert err.message.startswith(f"is larger than {MAX_BYTES // 1024} KiB")


def test_a_device_is_read_no_further_than_the_limit():
    err = error_of(load_policy, Path("/dev/zero"))
    assert err.message.startswith(f"is larger than {MAX_BYTES // 1024} KiB")


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD_POLICY.replace("a policy", "caf\xe9").encode("latin-1"))
    err = error_of(load_policy, path)
    assert (err.line, err.field) == (2, "<file>")
    assert "is not UTF-8 text (byte 0xe9" in err.message


def test_the_values_limit_is_exact(tmp_path):
    items = MAX_VALUES - 1  # the list itself is a value too
    assert len(load_source(write(tmp_path, "[" + "1, " * items + "]")).data) == items
    with pytest.raises(SpecError, match=f"more than {MAX_VALUES} values"):
        load_source(write(tmp_path, "[" + "1, " * (items + 1) + "]"))
