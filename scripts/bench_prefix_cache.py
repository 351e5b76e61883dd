"""What the prefix cache's bookkeeping costs: lookup and insert times over many entries that
share a long system prompt (the worst case for candidates at one block), next to what the
prefill those tokens save costs on the built-in model.

    python scripts/bench_prefix_cache.py --entries 200 --prompt-tokens 4000

Prints p50, p95, p99 and the worst (max) of each operation, and the ratio of a lookup to the
prefill it saves, measured in this one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402, F401  (first: a BLAS that runtime loads must precede MLX)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from runtime.model import load_model  # noqa: E402
from runtime.prefix_cache import PrefixCache  # noqa: E402


def _quantiles(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return (f"p50 {q[49] * 1e3:.3f} ms  p95 {q[94] * 1e3:.3f} ms  p99 {q[98] * 1e3:.3f} ms  "
            f"max {max(samples) * 1e3:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--shared-tokens", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(32, 127) for _ in range(args.shared_tokens)]
    rest = args.prompt_tokens - args.shared_tokens
    prompts = [system + [rng.randrange(32, 127) for _ in range(rest)]
               for _ in range(args.entries + 100)]
    layer = mx.zeros((1, 1, args.prompt_tokens, 1))  # bookkeeping only: one tiny layer
    cache = PrefixCache(args.prompt_tokens * (args.entries + 200))
    inserts, lookups = [], []
    for p in prompts[: args.entries]:
        start = time.perf_counter()
        cache.insert(p, [(layer, layer)])
        inserts.append(time.perf_counter() - start)
    for p in prompts[args.entries:]:
        start = time.perf_counter()
        hit = cache.lookup(p)
        lookups.append(time.perf_counter() - start)
        assert hit is not None and hit.num_tokens >= args.shared_tokens
    print(f"{args.entries} entries of {args.prompt_tokens} tokens sharing "
          f"{args.shared_tokens}:")
    print(f"  insert  {_quantiles(inserts)}")
    print(f"  lookup  {_quantiles(lookups)}")
    bundle = load_model(None)
    tokens = mx.array(system)[None]
    times = []
    for _ in range(3):
        kv = make_prompt_cache(bundle.model)
        start = time.perf_counter()
        mx.eval(bundle.model(tokens, cache=kv))
        times.append(time.perf_counter() - start)
    prefill_s = min(times)
    print(f"  prefill of the {args.shared_tokens} shared tokens (built-in model, one forward): "
          f"{prefill_s * 1e3:.1f} ms; p99 lookup / prefill = "
          f"{statistics.quantiles(lookups, n=100)[98] / prefill_s:.4f}")


if __name__ == "__main__":
    main()
