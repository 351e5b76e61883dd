"""scripts/bench_admission_matrix.py: starts its own server per arm, writes table and plot."""

from __future__ import annotations

import json

import bench_admission_matrix as matrix  # scripts/ is on sys.path (tests/conftest.py)

from statemachine.spec import shipped_policy_names
from tests.scripts.conftest import SMALL, png_size, run_script


def test_the_whole_matrix_has_an_arm_for_every_shipped_policy():
    # With no --arm the script runs "the whole matrix": every policy the server ships.
    assert {matrix.parse_arm(a).policy for a in matrix.DEFAULT_ARMS} == set(
        shipped_policy_names())


def test_one_arm_one_run_writes_table_json_and_plot(tmp_path):
    done = run_script("bench_admission_matrix.py", *SMALL, "--chunk", "16", "--repeats", "1",
                      "--streams", "2", "--arm", "mix=mixed_step", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "admission.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| mix |"))
    *_, before, meets, runs, _ = (cell.strip() for cell in row.split("|"))
    assert (before, runs) == ("1/1", "1 ok"), row  # first token before the streams' last
    assert meets in ("0/1", "1/1"), row  # runs that met the three figures
    assert "| arm | TTFT s |" in done.stdout
    [arm] = json.loads((tmp_path / "admission.json").read_text())
    assert (arm["label"], arm["policy"], arm["refused"]) == ("mix", "mixed_step", [])
    [result] = arm["results"]
    assert result["policy"] == "mixed_step" and result["ttft_s"] > 0
    width, height = png_size(tmp_path / "admission.png")  # a PNG, whatever its size
    assert width > 0 and height > 0
    assert "Server Stopped" in (tmp_path / "serve-mix.log").read_text(), "the arm's server log"


def test_a_token_budget_arm_reports_its_ticks_against_their_target(tmp_path):
    # token_budget sizes each mixed tick's slice for a latency target; the run reports
    # how many ticks in the admission window were sized so, and how many overshot it (from
    # /metrics: fairtick_tick_over_target_ratio), and mixed_step, without a target, none.
    done = run_script("bench_admission_matrix.py", *SMALL, "--chunk", "16", "--repeats", "1",
                      "--streams", "2", "--arm", "tb=token_budget", "--arm", "mix=mixed_step",
                      "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    arms = {arm["label"]: arm for arm in json.loads((tmp_path / "admission.json").read_text())}
    [budgeted], [mixed] = arms["tb"]["results"], arms["mix"]["results"]
    ticks = budgeted["over_target"]["mixed"]["ticks"] + budgeted["over_target"]["probe"]["ticks"]
    assert ticks >= 1, budgeted["over_target"]
    for kind in ("mixed", "probe"):
        shares = budgeted["over_target"][kind]
        if shares["ticks"]:
            assert 0 <= shares["over_1.25"] <= shares["over_1"] <= 1, shares
    assert all(t["ticks"] == 0 for t in mixed["over_target"].values()), mixed["over_target"]
    assert "| mixed ticks > target | probe ticks > target |" in \
        (tmp_path / "admission.md").read_text()
