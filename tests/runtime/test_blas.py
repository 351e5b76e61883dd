"""The BLAS under MLX (runtime/blas.py): what libmlx's `cblas_sgemm` really binds to, read from
the dynamic linker's own record (LD_DEBUG=bindings) in a fresh interpreter, for each setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.blas import BLAS_ENV, load_blas, parse_setting

REPO = Path(__file__).resolve().parents[2]
# Prints what runtime.blas reports, after one float32 matmul made libmlx bind cblas_sgemm.
REPORT = """
import json, mlx.core as mx
from runtime.blas import load_blas
info = load_blas()
a = mx.ones((8, 8)); mx.eval(a @ a)
maps = open("/proc/self/maps").read()
print(json.dumps({"library": info.library and str(info.library), "reason": info.reason,
                  "unavailable": info.unavailable, "preload": info.preload and str(info.preload),
                  "mapped": bool(info.library) and str(info.library) in maps,
                  "openblas_mapped": "libscipy_openblas" in maps}))
"""


def run_report(tmp_path: Path, setting: str, first: str = "import runtime",
               **env: str) -> tuple[dict[str, object], list[str]]:
    """REPORT in a fresh interpreter after `first`: (its report, the libraries the dynamic
    linker bound libmlx's cblas_sgemm to)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "ld"
    done = subprocess.run(
        [sys.executable, "-c", f"{first}\n{REPORT}"], cwd=REPO, capture_output=True, text=True,
        timeout=120, env={**os.environ, BLAS_ENV: setting, "LD_DEBUG": "bindings",
                          "LD_DEBUG_OUTPUT": str(log), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    bound = [line.split(" to ", 1)[1].split(" [")[0]
             for path in tmp_path.glob("ld.*") for line in path.read_text().splitlines()
             if "`cblas_sgemm'" in line and "libmlx.so" in line.split(" to ", 1)[0]]
    return json.loads(done.stdout.splitlines()[-1]), bound


def optimized_or_skip(report: dict[str, object]) -> str:
    """The optimized library; a skip only where none can be had (any other miss fails)."""
    if report["unavailable"]:
        pytest.skip(f"no optimized BLAS can be had on this machine: {report['reason']}")
    assert report["library"] is not None, report
    return str(report["library"])


def test_by_default_libmlx_binds_openblas(tmp_path):
    report, bound = run_report(tmp_path, "auto")
    library = optimized_or_skip(report)
    assert "openblas" in library and report["mapped"], report
    assert bound == [report["preload"]] and "blas-shim-" in bound[0], (bound, report)


def test_the_test_process_itself_runs_on_the_optimized_blas():
    info = load_blas()
    if os.environ.get(BLAS_ENV) == "reference":
        pytest.skip(f"this test run asked for the reference BLAS ({BLAS_ENV}=reference)")
    optimized_or_skip({"library": info.library, "reason": info.reason,
                       "unavailable": info.unavailable})
    assert str(info.library) in Path("/proc/self/maps").read_text()


def test_a_directory_named_mlx_before_the_installed_one_changes_nothing(tmp_path):
    # `mlx` is a namespace package: a directory of that name earlier on sys.path (a checkout
    # of MLX's sources) joins it, and libmlx is not in it.
    plain, _ = run_report(tmp_path / "plain", "auto")
    library = optimized_or_skip(plain)
    (tmp_path / "shadow" / "mlx").mkdir(parents=True)
    report, bound = run_report(tmp_path, "auto", PYTHONPATH=str(tmp_path / "shadow"))
    assert report["library"] == library and report["mapped"], report
    assert bound == [report["preload"]], (bound, report)


def test_reference_keeps_the_bundled_blas(tmp_path):
    report, bound = run_report(tmp_path, "reference")
    assert report["library"] is None and BLAS_ENV in str(report["reason"])
    assert not report["openblas_mapped"], "reference must load no OpenBLAS at all"
    assert len(bound) == 1 and "mlx_cpu.libs/libblas" in bound[0], bound


def test_mlx_imported_first_is_reported_not_hidden(tmp_path):
    # libmlx fixes its lookup scope when it loads: a BLAS loaded after it is never used.
    report, bound = run_report(tmp_path, "auto", first="import mlx.core\nimport runtime")
    assert report["library"] is None and "import runtime first" in str(report["reason"])
    assert "mlx_cpu.libs/libblas" in bound[0], bound


@pytest.mark.parametrize(("name", "value", "said"), [
    ("CC", "/nonexistent/cc", "no C compiler"),
    ("FAIRTICK_CACHE", "/proc/no-cache-here", "/proc/no-cache-here"),  # cannot be created
])
def test_without_a_way_to_the_shim_it_says_why_and_runs_on_the_reference(tmp_path, name, value,
                                                                         said):
    env = {"FAIRTICK_CACHE": str(tmp_path / "fresh-cache"), name: value}
    report, bound = run_report(tmp_path, "auto", **env)
    if "scipy-openblas32" in str(report["reason"]):
        pytest.skip(str(report["reason"]))  # no OpenBLAS wheel here: the shim is not reached
    assert report["unavailable"] and said in str(report["reason"]), report
    assert "mlx_cpu.libs/libblas" in bound[0], bound


def test_a_library_path_is_loaded_in_its_place(tmp_path):
    default, bound = run_report(tmp_path / "default", "auto")
    optimized_or_skip(default)
    shim = bound[0]  # a library exporting the standard CBLAS names
    report, bound = run_report(tmp_path, shim)
    assert report["library"] == shim and bound == [shim]


def test_ld_preload_gives_another_mlx_program_the_same_blas(tmp_path):
    default, _ = run_report(tmp_path / "default", "auto")
    optimized_or_skip(default)
    # mlx first, as mlx_lm.server does: only the preload can reach libmlx then.
    _, bound = run_report(tmp_path, "reference", first="import mlx.core",
                          LD_PRELOAD=str(default["preload"]))
    assert bound == [default["preload"]]


def test_a_library_without_the_cblas_names_is_refused(tmp_path):
    default, _ = run_report(tmp_path, "auto")
    prefixed = optimized_or_skip(default)  # exports scipy_cblas_sgemm, not cblas_sgemm
    done = subprocess.run([sys.executable, "-c", "import runtime"], cwd=REPO, text=True,
                          capture_output=True, timeout=60, env={**os.environ, BLAS_ENV: prefixed})
    assert done.returncode != 0 and "cblas_sgemm" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize("value", ["openblas", "", "/no/such/libblas.so"])
def test_a_bad_setting_names_the_allowed_values(value):
    with pytest.raises(ValueError, match="'auto', 'reference' or the path"):
        parse_setting(value)
