"""The `fairtick` command line: help, policy flags and their precedence, trace, check."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml
from sanic import Sanic

from runtime.blas import BLAS_ENV, load_blas
from server import listener
from server.cli import API_KEY_ENV, main
from server.config import ServerConfig
from server.logs import LOG_LEVEL_ENV
from server.policy_flags import flag_dest, resolve_policy_params
from server.validation import DEFAULT_CHAT_MAX_TOKENS
from statemachine.lifecycle import DEFAULT_LIFECYCLE
from statemachine.spec import load_policy
from tests.lifecycle_names import ADMIT, FINISHED
from tests.server.http_helpers import post
from tests.server.serving import serve


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("serve", "trace", "check"))


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    assert "choose a command" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "trace", "check"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"fairtick {command}" in capsys.readouterr().out


def test_serve_help_shows_the_chosen_policys_flags(capsys):
    spec = load_policy("grant_counter")
    with pytest.raises(SystemExit):
        main(["serve", "--policy", "grant_counter", "--help"])
    out = capsys.readouterr().out
    for p in spec.parameters:
        assert p.flag in out and p.env in out


def test_an_invalid_policy_spec_refuses_to_start(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndoc: x\nrules: []\nclaims: {}\n")
    assert main(["serve", "--policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid policy spec" in err and "bad.yaml" in err and "rules" in err


def test_a_lifecycle_without_the_states_the_policy_needs_refuses_to_start(tmp_path, capsys):
    # The default policy recomputes a preempted sequence (kv_full: recompute), and the server
    # always has a KV budget: a lifecycle with no preempted state ended start-up in a traceback
    # and exit 1, after the port was bound and the model loaded.
    doc = yaml.safe_load(DEFAULT_LIFECYCLE.read_text())
    gone = next(name for name, state in doc["states"].items() if state["role"] == "preempted")
    doc["states"].pop(gone)
    edges = []
    for edge in doc["transitions"]:
        sources = edge["source"] if isinstance(edge["source"], list) else [edge["source"]]
        if edge["dest"] != gone and [s for s in sources if s != gone]:
            edges.append({**edge, "source": [s for s in sources if s != gone]})
    doc["transitions"] = edges
    life = tmp_path / "no-preempted.yaml"
    life.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert main(["serve", "--lifecycle", str(life)]) == 2
    err = capsys.readouterr().err
    default = load_policy("default").name
    assert f"kv_full: recompute (policy {default}) needs a state with role preempted" in err
    assert "Traceback" not in err


def test_an_unknown_policy_refuses_to_start(capsys):
    assert main(["serve", "--policy", "no_such_policy"]) == 2
    assert "no_such_policy" in capsys.readouterr().err


def test_an_out_of_range_parameter_refuses_to_start(capsys):
    p = load_policy("grant_counter").parameters[0]
    assert main(["serve", "--policy", "grant_counter", p.flag, str(p.maximum + 1)]) == 2
    err = capsys.readouterr().err
    assert p.flag in err and f"[{p.minimum}, {p.maximum}]" in err


def test_an_invalid_parameter_env_var_refuses_to_start(monkeypatch, capsys):
    p = load_policy("grant_counter").parameters[0]
    monkeypatch.setenv(p.env, "lots")
    assert main(["serve", "--policy", "grant_counter"]) == 2
    assert p.env in capsys.readouterr().err


def test_a_bad_blas_setting_refuses_to_start(monkeypatch, capsys):
    monkeypatch.setenv(BLAS_ENV, os.environ.get(BLAS_ENV, ""))  # restored after the test
    assert main(["serve", "--blas", "openblas"]) == 2
    assert "'auto', 'reference' or the path" in capsys.readouterr().err


def test_a_bad_softmax_setting_refuses_to_start(monkeypatch, capsys):
    monkeypatch.setenv("FAIRTICK_SOFTMAX", "quick")
    assert main(["serve"]) == 2
    assert "$FAIRTICK_SOFTMAX='quick': expected one of ('auto', 'exact')" in \
        capsys.readouterr().err


def test_a_bad_attention_streams_setting_refuses_to_start(monkeypatch, capsys):
    monkeypatch.setenv("FAIRTICK_ATTENTION_STREAMS", "many")
    assert main(["serve"]) == 2
    assert "$FAIRTICK_ATTENTION_STREAMS='many': expected one of ('1', '2')" in \
        capsys.readouterr().err


def test_a_bad_attention_kernel_setting_refuses_to_start(monkeypatch, capsys):
    monkeypatch.setenv("FAIRTICK_ATTENTION_KERNEL", "fast")
    assert main(["serve"]) == 2
    assert "$FAIRTICK_ATTENTION_KERNEL='fast': expected one of ('auto', 'off')" in \
        capsys.readouterr().err


@pytest.mark.parametrize("where", ["a-file", "a-file/below"])
def test_a_cache_directory_that_cannot_be_used_refuses_to_start(where, tmp_path, monkeypatch,
                                                                capsys):
    # It ended start-up in a traceback and exit 1 once the built-in model was written there.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FAIRTICK_CACHE", str(tmp_path / where))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert f"$FAIRTICK_CACHE='{tmp_path / where}' cannot be used" in err, err
    assert "Traceback" not in err


def test_blas_cannot_change_in_a_process_that_already_loaded_one(monkeypatch, capsys):
    monkeypatch.setenv(BLAS_ENV, os.environ.get(BLAS_ENV, ""))
    other = "auto" if load_blas().setting == "reference" else "reference"
    assert main(["serve", "--blas", other]) == 2
    assert "already runs on" in capsys.readouterr().err


@pytest.fixture
def served_as(monkeypatch) -> Iterator:
    """main(["serve", *flags]) builds the real app (server.app.create_app) from its flags; only
    the listening socket and Sanic's blocking `run` are kept from serving. Returns the app,
    run's keywords and the address the socket was bound to (host, port). (That the backlog
    reaches the kernel and the grace period the engine: tests/e2e; a real bind:
    tests/server/test_listener.py, tests/e2e/test_bind_errors.py.)"""
    seen: dict = {}
    sock = object()

    def bind(host: str, port: int) -> object:
        seen.update(bound=(host, port), sock=sock)
        return sock

    def run(app, **kwargs) -> None:
        seen.update(app=app, run=kwargs)

    monkeypatch.setattr(listener, "bind_listener", bind)
    monkeypatch.setattr(Sanic, "run", run)

    def serve_with(*flags: str) -> dict:
        assert main(["serve", *flags]) == 0
        return seen

    # `serve` configures this process's logging: give the next tests theirs back.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield serve_with
    root.handlers[:] = handlers
    root.setLevel(level)


def test_serve_passes_its_flags_to_the_app_and_to_run(served_as):
    seen = served_as("--listen-backlog", "2048", "--stop-grace-s", "0.5", "--port", "8123",
                     "--max-body-bytes", "5000", "--parallel", "3", "--policy", "deadline")
    config, run = seen["app"].ctx.config, seen["run"]
    assert seen["bound"] == ("127.0.0.1", 8123) == (config.host, config.port)
    assert run["sock"] is seen["sock"] and "host" not in run and "port" not in run
    assert run["backlog"] == 2048 == config.listen_backlog
    assert config.stop_grace_s == 0.5
    assert seen["app"].config.REQUEST_MAX_SIZE == 5000
    assert (config.engine.max_running, config.engine.policy) == (3, "deadline")
    assert dict(config.engine.policy_params) == load_policy("deadline").defaults


def test_the_lane_priority_comes_from_its_flag_then_its_env(served_as, monkeypatch):
    monkeypatch.delenv("FAIRTICK_LANE_PRIORITY", raising=False)
    assert served_as()["app"].ctx.config.engine.lane_priority == "idle"
    monkeypatch.setenv("FAIRTICK_LANE_PRIORITY", "normal")
    assert served_as()["app"].ctx.config.engine.lane_priority == "normal"
    assert served_as("--lane-priority", "idle")["app"].ctx.config.engine.lane_priority == "idle"


def test_serve_defaults_come_from_the_server_config(served_as):
    seen = served_as()
    config = seen["app"].ctx.config
    assert seen["run"]["backlog"] == ServerConfig().listen_backlog == config.listen_backlog
    assert config.stop_grace_s == ServerConfig().stop_grace_s


def test_the_api_flags_reach_the_server_config(served_as, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    config = served_as("--served-model-name", "org/model", "alias", "--default-chat-max-tokens",
                       "7", "--api-key", "sk-flag", "--api-key-protect-ops", "--allowed-origins",
                       "https://a.example, http://localhost:3000")["app"].ctx.config
    assert config.served_model_names == ("org/model", "alias")
    assert config.default_chat_max_tokens == 7
    assert (config.api_key, config.api_key_protect_ops) == ("sk-flag", True)
    assert config.allowed_origins == ("https://a.example", "http://localhost:3000")
    assert "sk-flag" not in repr(config), "the key stays out of logs"
    assert served_as()["app"].ctx.config.api_key == "sk-from-env"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert served_as()["app"].ctx.config.api_key is None, "an empty variable is no key"


def test_the_api_flags_default_to_off(served_as, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = served_as()["app"].ctx.config
    assert (config.served_model_names, config.api_key, config.allowed_origins) == ((), None, ())
    assert config.default_chat_max_tokens == DEFAULT_CHAT_MAX_TOKENS == 2048


def test_the_log_flags_reach_the_config_and_run(served_as, monkeypatch):
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    seen = served_as()
    assert (seen["app"].ctx.config.log_level, seen["run"]["access_log"]) == ("info", False)
    seen = served_as("--log-level", "DEBUG", "--access-log")
    assert seen["app"].ctx.config.log_level == "DEBUG" and seen["run"]["access_log"] is True
    assert logging.getLogger().level == logging.DEBUG
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    assert served_as()["app"].ctx.config.log_level == "warning"
    assert logging.getLogger().level == logging.WARNING
    assert served_as("--log-level", "error")["app"].ctx.config.log_level == "error", \
        "the flag wins over the variable"


def test_a_bad_log_level_variable_refuses_to_start(monkeypatch, capsys):
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert LOG_LEVEL_ENV in err and "'loud'" in err and "debug, info, warning" in err


@pytest.mark.parametrize("flags", [("--log-level", "loud"), ("--stop-grace-s", "-1"),
                                   ("--stop-grace-s", "nan"),
                                   ("--stop-grace-s", "inf"), ("--listen-backlog", "0"),
                                   ("--default-chat-max-tokens", "0"),
                                   ("--served-model-name", "a", "a"),
                                   ("--served-model-name", " a"),
                                   ("--api-key", "two words"), ("--api-key", ""),
                                   ("--api-key-protect-ops",),
                                   ("--allowed-origins", "ftp://a.example"),
                                   ("--allowed-origins", "https://a.example/path"),
                                   ("--allowed-origins", "https://a.example,,http://b"),
                                   ("--lane-priority", "low")])
def test_a_bad_server_setting_refuses_to_start(flags, capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["serve", *flags]) == 2
    assert flags[0] in capsys.readouterr().err  # the flag the user typed, not the field


def test_a_waiting_queue_of_0_refuses_to_start(capsys):
    # Every request waits in the queue before its first admission, however idle the server:
    # with no place in it, every request would get 429 for ever.
    assert main(["serve", "--max-waiting", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-waiting must be an integer >= 1, got 0" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags", [("--max-running", "0"), ("--parallel", "0"),
                                   ("--prefill-chunk-size", "0"), ("--max-kv-tokens", "0"),
                                   ("--prefix-cache-tokens", "0"), ("--trace-capacity", "0"),
                                   ("--max-body-bytes", "10")])
def test_a_bad_setting_is_named_by_its_flag(flags, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip()
    # --parallel is --max-running's other name: the message names the flag's first name.
    flag = "--max-running" if flags[0] == "--parallel" else flags[0]
    assert err.startswith(f"fairtick serve: {flag} must be ") and f"got {flags[1]}" in err
    assert "_" not in err.split(" must ")[0]


def test_parameter_precedence_flag_then_env_then_default():
    spec = load_policy("grant_counter")
    p = spec.parameters[0]
    low, high = p.minimum, p.maximum
    assert resolve_policy_params(spec, {}, {}) == spec.defaults
    assert resolve_policy_params(spec, {}, {p.env: str(high)})[p.name] == high
    flags = {flag_dest(p.name): str(low)}
    assert resolve_policy_params(spec, flags, {p.env: str(high)})[p.name] == low


def test_parameter_values_are_checked_by_the_spec():
    spec = load_policy("grant_counter")
    p = spec.parameters[0]
    with pytest.raises(ValueError, match=p.flag):
        resolve_policy_params(spec, {flag_dest(p.name): "nan"}, {})
    with pytest.raises(ValueError, match="expected a number"):
        resolve_policy_params(spec, {flag_dest(p.name): "many"}, {})


def test_check_imports_neither_mlx_nor_sanic():
    code = ("import sys\nfrom server.cli import main\n"
            "try:\n    main(['check', '--help'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('mlx', 'sanic') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


def test_serve_imports_no_ray():
    # Ray is the cluster extra: the single-machine server never needs it.
    code = ("import sys\nfrom server.cli import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "from server.app import create_app\nfrom server.config import ServerConfig\n"
            "create_app(ServerConfig())\n"
            "assert 'sanic' in sys.modules and 'runtime.engine' in sys.modules\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'cluster')]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


@pytest.fixture(scope="module")
def traced_url(bundle):
    with serve(bundle) as served:
        post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        yield served.url


def test_trace_prints_a_table(traced_url, capsys):
    assert main(["trace", "--url", traced_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["tick", "t_s", "request", "seq", "from", "to", "trigger", "rule"]
    assert "arrive" in out[1].split() and ADMIT in out[2].split()


def test_trace_json_lines(traced_url, capsys):
    assert main(["trace", "--url", traced_url, "--json", "--since", "0", "--limit", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["to"] == FINISHED  # the latest event
    assert main(["trace", "--url", traced_url, "--json", "--state", FINISHED]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert events and all(FINISHED in (e["from"], e["to"]) for e in events)


def test_trace_of_an_unreachable_server(capsys):
    assert main(["trace", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_trace_sends_the_key_a_locked_server_asks_for(bundle, capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    server = {"api_key": "sk-ops", "api_key_protect_ops": True}
    with serve(bundle, server=server) as served:
        assert main(["trace", "--url", served.url]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert main(["trace", "--url", served.url, "--api-key", "sk-ops"]) == 0
        monkeypatch.setenv(API_KEY_ENV, "sk-ops")
        assert main(["trace", "--url", served.url, "--json"]) == 0


def test_a_parameter_with_a_fractional_range_takes_fractions_and_an_integral_one_does_not():
    budget, counter = load_policy("token_budget"), load_policy("grant_counter")
    factor = next(p for p in budget.parameters if p.name == "itl_factor")
    interval = counter.parameters[0]
    assert resolve_policy_params(budget, {flag_dest(factor.name): "3.5"}, {})[factor.name] == 3.5
    with pytest.raises(ValueError, match="must be an integer"):
        resolve_policy_params(counter, {flag_dest(interval.name): "3.5"}, {})
