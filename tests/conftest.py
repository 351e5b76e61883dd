"""Makes `scripts/benchlib` importable for every test: the tests start servers and talk HTTP
with the same helpers the benchmark scripts use."""

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
