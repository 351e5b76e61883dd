"""Set-up shared by every test.

- `scripts/benchlib` is importable: the tests start servers and talk HTTP with the same helpers
  the benchmark scripts use.
- `runtime` is imported before any test module imports MLX, so the tests run on the BLAS that
  `fairtick serve` runs on (runtime/blas.py), and the compiled kernels (the fast softmax,
  runtime/attention.py; RMSNorm and the rope rotation, runtime/kernels.py) are built here,
  once, before tests start servers and replicas that load them.
- Hypothesis runs under the `fairtick` profile, loaded here before any test module builds its
  own `settings(...)` (which inherit from it): every failure prints a `@reproduce_failure` blob,
  so a failure found on any machine can be replayed exactly, whatever example database it had.
"""

import sys
from pathlib import Path

from hypothesis import settings

import runtime  # noqa: F401
from runtime import kernels

kernels.warm_up()

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

HYPOTHESIS_PROFILE = "fairtick"
settings.register_profile(HYPOTHESIS_PROFILE, print_blob=True)
settings.load_profile(HYPOTHESIS_PROFILE)
