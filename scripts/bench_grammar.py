"""The grammar libraries measured side by side: compile time, mask time per token, correctness.

For each engine (llguidance, xgrammar, outlines-core: whichever are installed, or --engines)
and each tokenizer (the built-in model's 258-token byte-level one, and byte-level BPE
vocabularies trained here on the Python standard library's source with the `tokenizers`
library, 32,000 and 128,000 tokens by default, cached in $FAIRTICK_CACHE/bench-tokenizers):

- compile: seconds to turn the schema into something a matcher runs (fresh each time; the median
  of --compile-reps) and to the first mask of a new matcher;
- mask: B random walks (B = 1, 4, 16) advance in lockstep through the schema's language; each
  step fills the B rows' next-token bitmasks (timed: p50/p95/p99/max per step) and then consumes
  one allowed token per row, drawn uniformly (EOS with probability 1/2 when allowed), also timed;
  then --walks walks run to their end (at most 3,000 tokens), one at a time;
- correctness: seeded random documents of the schema (checked valid; strings with escapes and
  non-ASCII), tokenized, must be accepted; documents that break one rule each (a missing required
  property, an extra property, an enum value, a type inside an array, no anyOf branch, ...;
  each checked invalid with `jsonschema` first) must be refused; every walk that ended must
  parse and validate.

    .venv/bin/python scripts/bench_grammar.py [--engines llguidance,outlines-core]
        [--vocab builtin,32000,128000] [--steps 300] [--json out.json]

`llguidance-serial` is llguidance filling a batch's rows one after another on the calling thread
(what runtime/grammar.py does); `llguidance` uses its own thread pool (`LLExecutor`).
xgrammar needs torch (its CUDA build from PyPI, several GB); measure it from a separate venv:
    python -m venv /tmp/xgr
    /tmp/xgr/bin/pip install xgrammar 'mlx[cpu]' mlx-lm scipy-openblas32 jsonschema
    /tmp/xgr/bin/python scripts/bench_grammar.py --engines xgrammar
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchlib.grammar_cases import (  # noqa: E402
    SCHEMAS,
    invalid_documents,
    tokenizer_json,
    valid_documents,
)
from benchlib.grammar_engines import ENGINES, Engine, allowed  # noqa: E402

WALK_CAP = 3000  # tokens; a walk still open then counts as unfinished
# A random walk may write an integer of thousands of digits: valid JSON that Python's int
# parsing refuses by default (4,300 digits).
sys.set_int_max_str_digits(0)


def quantiles_ms(values: list[float]) -> dict[str, float]:
    arr = np.array(values) * 1e3
    return {"p50": float(np.quantile(arr, 0.5)), "p95": float(np.quantile(arr, 0.95)),
            "p99": float(np.quantile(arr, 0.99)), "max": float(arr.max()), "n": len(values)}


def time_compile(engine: Engine, schema: dict[str, Any], reps: int) -> dict[str, float]:
    compile_s, first_mask_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        t1 = time.perf_counter()
        m = engine.matcher(compiled)
        engine.fill([m], np.zeros((1, _words(engine)), dtype=np.int32))
        t2 = time.perf_counter()
        compile_s.append(t1 - t0)
        first_mask_s.append(t2 - t1)
    return {"compile_s": statistics.median(compile_s),
            "first_mask_s": statistics.median(first_mask_s)}


def walk(engine: Engine, compiled: Any, batch: int, steps: int | None, vocab: int, eos: int,
         rng: random.Random, num_walks: int | None = None) -> dict[str, Any]:
    """B lockstep walks for `steps` steps (or until `num_walks` walks ended): the mask time per
    step, the consume time per step, and every finished walk's text (token ids)."""
    rows = [engine.matcher(compiled) for _ in range(batch)]
    texts: list[list[int]] = [[] for _ in range(batch)]
    done: list[list[int]] = []
    bitmask = np.zeros((batch, _words(engine)), dtype=np.int32)
    mask_s, consume_s, unfinished, step = [], [], 0, 0
    while (step < steps) if steps is not None else (len(done) + unfinished < (num_walks or 0)):
        step += 1
        bitmask[:] = 0
        t0 = time.perf_counter()
        engine.fill(rows, bitmask)
        mask_s.append(time.perf_counter() - t0)
        picks = [_pick(allowed(bitmask[i], vocab), eos, rng) for i in range(batch)]
        t1 = time.perf_counter()
        ok = [engine.consume(m, t) for m, t in zip(rows, picks, strict=True)]
        consume_s.append(time.perf_counter() - t1)
        for i, token in enumerate(picks):
            if not ok[i]:
                raise AssertionError(f"{engine.name} refused a token its own mask allowed")
            if token == eos or len(texts[i]) >= WALK_CAP:
                if token == eos:
                    done.append(texts[i])
                else:
                    unfinished += 1
                rows[i], texts[i] = engine.matcher(compiled), []
            else:
                texts[i].append(token)
    return {"mask": quantiles_ms(mask_s), "consume": quantiles_ms(consume_s), "done": done,
            "unfinished": unfinished}


def _pick(tokens: np.ndarray, eos: int, rng: random.Random) -> int:
    if len(tokens) == 0:
        raise AssertionError("the mask allows no token")
    if eos in tokens and (len(tokens) == 1 or rng.random() < 0.5):
        return eos
    choice = int(tokens[rng.randrange(len(tokens))])
    return choice if choice != eos else int(tokens[0] if tokens[0] != eos else tokens[1])


def _words(engine: Engine) -> int:
    return (engine.vocab_size + 31) // 32  # type: ignore[attr-defined]


def accepts(engine: Engine, compiled: Any, tokens: list[int], eos: int) -> bool:
    m = engine.matcher(compiled)
    return all(engine.consume(m, t) for t in tokens) and engine.consume(m, eos)


def correctness(engine: Engine, compiled: Any, schema_name: str, encode: Any, decode: Any,
                eos: int, walks: list[list[int]]) -> dict[str, Any]:
    import jsonschema

    schema = SCHEMAS[schema_name]
    report: dict[str, Any] = {}
    valid = valid_documents(schema_name)
    texts = [json.dumps(d, ensure_ascii=False) for d in valid]  # ", " and ": " between items
    refused = [t for t in texts if not accepts(engine, compiled, encode(t), eos)]
    report["valid"] = f"{len(texts) - len(refused)}/{len(texts)} accepted"
    if refused:
        report["valid_refused_example"] = refused[0][:200]
    bad = invalid_documents(schema_name)
    let_through = [name for name, doc in bad.items()
                   if accepts(engine, compiled, encode(json.dumps(doc)), eos)]
    report["invalid"] = f"{len(bad) - len(let_through)}/{len(bad)} refused"
    if let_through:
        report["invalid_let_through"] = let_through
    failures: list[str] = []
    for tokens in walks:
        try:
            jsonschema.validate(json.loads(decode(tokens)), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(str(exc).split("\n")[0][:160])
    report["walks"] = f"{len(walks) - len(failures)}/{len(walks)} finished walks valid"
    if failures:
        report["walk_failures"] = sorted(set(failures))[:3]
    return report


def measure(engine_name: str, vocab: str, args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    text, eos = tokenizer_json(vocab)
    tok = Tokenizer.from_str(text)
    t0 = time.perf_counter()
    engine = ENGINES[engine_name](text, eos)
    setup_s = time.perf_counter() - t0
    engine.vocab_size = tok.get_vocab_size()  # type: ignore[attr-defined]
    out: dict[str, Any] = {"engine": engine_name, "vocab": tok.get_vocab_size(),
                           "setup_s": setup_s, "schemas": {}}
    for name in args.schemas.split(","):
        rng = random.Random(args.seed)
        entry: dict[str, Any] = time_compile(engine, SCHEMAS[name], args.compile_reps)
        compiled = engine.compile(SCHEMAS[name])
        for batch in (1, 4, 16):
            run = walk(engine, compiled, batch, args.steps, engine.vocab_size, eos, rng)
            run.pop("done")
            entry[f"batch_{batch}"] = run
        # Walks run to their end (or WALK_CAP tokens), for the correctness of what they wrote.
        ended = walk(engine, compiled, 1, None, engine.vocab_size, eos, rng, args.walks)
        walks = ended["done"]
        entry["unfinished_walks"] = ended["unfinished"]
        entry["correctness"] = correctness(
            engine, compiled, name, lambda s: tok.encode(s, add_special_tokens=False).ids,
            lambda ids: tok.decode(ids, skip_special_tokens=False), eos, walks)
        out["schemas"][name] = entry
        print(json.dumps({"engine": engine_name, "vocab": out["vocab"], "schema": name,
                          **_brief(entry)}), flush=True)
    return out


def _brief(entry: dict[str, Any]) -> dict[str, Any]:
    brief = {"compile_ms": round(entry["compile_s"] * 1e3, 2),
             "first_mask_ms": round(entry["first_mask_s"] * 1e3, 2)}
    for b in (1, 4, 16):
        m = entry[f"batch_{b}"]["mask"]
        brief[f"mask_b{b}_ms"] = {k: round(v, 3) for k, v in m.items() if k != "n"}
        brief[f"consume_b{b}_p50_ms"] = round(entry[f"batch_{b}"]["consume"]["p50"], 3)
    brief["unfinished_walks"] = entry["unfinished_walks"]
    brief.update(entry["correctness"])
    return brief


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default=None,
                        help="comma-separated; default: every one that imports")
    parser.add_argument("--vocab", default="builtin,32000,128000")
    parser.add_argument("--schemas", default="order,json_object")
    parser.add_argument("--steps", type=int, default=300, help="lockstep steps per batch size")
    parser.add_argument("--compile-reps", type=int, default=3)
    parser.add_argument("--walks", type=int, default=30,
                        help="walks run to their end for the correctness check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args()
    names = args.engines.split(",") if args.engines else [n for n in ENGINES if _importable(n)]
    results = [measure(e, v, args) for e in names for v in args.vocab.split(",")]
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def _importable(name: str) -> bool:
    import importlib.util

    module = {"outlines-core": "outlines_core", "llguidance-serial": "llguidance"}.get(name, name)
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
