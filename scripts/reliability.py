#!/usr/bin/env python3
"""Reliability check of a running fairtick server, over HTTP only (standard library,
Hypothesis, scripts/benchlib, and the server's body models for the bodies phase's JSON schemas).

Phases (all by default; `--phases` picks some):

- load: many concurrent SSE streams; each must receive exactly `max_tokens` tokens, equal to a
  reference greedy completion of the same prompt made alone first, with agreeing usage.
- storm: hundreds of streams, about half cut at random points (before the answer, or after k
  tokens); afterwards the gauges and /debug/state are back to idle, the server's RSS is back near
  its start (with --pid), and a normal request is exactly what it was before the storm.
- fuzz: Hypothesis generates malformed and edge-case requests; every answer must be a 2xx or an
  OpenAI-style JSON 4xx, never a 5xx, reset or hang; /health stays ok.
- bodies: `--fuzz-bodies` N bodies: half of OpenAI's documented shapes with wrong-typed, nested
  or extreme values anywhere in them (reliabilitylib/bodies.py), half drawn from the body models'
  JSON schemas, changed the same way or not, for the generation endpoints, /tokenize and
  /detokenize (reliabilitylib/schema_bodies.py); every answer must be a 2xx or a JSON 4xx naming
  a field the body changed (or holds, for a schema body), never a 5xx or a dropped connection;
  statuses are counted.
- overload: far more simultaneous requests than --max-running + --max-waiting; every one must be a
  completion or a 429 with Retry-After.

The built-in model emits one printable character per token and never EOS, so a stream's text
length is its token count. Prints a table per phase; exit 1 on any loss, crash, 5xx to valid
input, drop or hang; exit 2 when the server cannot be reached.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The bodies phase draws from the server's own body models: this checkout's, not an install's.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from benchlib.client import Reply  # noqa: E402
from reliabilitylib import cli  # noqa: E402
from reliabilitylib.fuzz import classify  # noqa: E402
from reliabilitylib.streams import Reference, Stream, problems  # noqa: E402
from reliabilitylib.target import failure_kind  # noqa: E402

# The parts live in scripts/reliabilitylib; tests judge the script by these names.
__all__ = ["Reference", "Reply", "Stream", "classify", "failure_kind", "main", "problems"]


def main(argv: list[str] | None = None) -> int:
    """Run the reliability check (see the module docstring); the exit status."""
    return cli.main(argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
