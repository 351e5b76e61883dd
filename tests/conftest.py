"""Makes `scripts/benchlib` importable for every test: the tests start servers and talk HTTP
with the same helpers the benchmark scripts use. Imports `runtime` before any test module
imports MLX, so the tests run on the BLAS that `fairtick serve` runs on (runtime/blas.py)."""

import sys
from pathlib import Path

import runtime  # noqa: F401

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
