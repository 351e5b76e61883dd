"""scripts/bench_admission_matrix.py: starts its own server per arm, writes table and plot."""

from __future__ import annotations

import json

from tests.scripts.conftest import SMALL, png_size, run_script


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
