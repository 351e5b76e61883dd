#!/usr/bin/env python3
"""The admission scenario against a running `fairtick serve`.

N decode streams run; after a quiet window one long prompt is admitted. Prints the prompt's
TTFT against its TTFT alone on the idle server, the streams' inter-token latency (ITL) in the
quiet and admission windows with the p95 inflation, and the scheduler counter deltas.
Exit 0 with the report; 2 with "NOT COMPARABLE: <reason>" when the latencies cannot be
attributed to the admission; 1 when the server cannot be used.

    .venv/bin/fairtick serve --policy mixed_step --max-running 5 --port 8000 &
    .venv/bin/python scripts/bench_mixed_step_admission.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import sys

from benchlib.admission import run_admission
from benchlib.attribution import NotComparable
from benchlib.client import ServerError
from benchlib.options import add_admission_options, config_from_args
from benchlib.report import format_run, to_jsonable


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    add_admission_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args, args.url)
    except ValueError as exc:
        p.error(str(exc))
    try:
        result = run_admission(cfg)
    except NotComparable as exc:
        if args.json:
            print(json.dumps({"comparable": False, "reason": str(exc)}))
        else:
            print(f"NOT COMPARABLE: {exc}")
        return 2
    except (ServerError, TimeoutError, OSError) as exc:
        print(f"bench_mixed_step_admission: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"comparable": True, **to_jsonable(result)}))
    else:
        print(format_run(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
