"""Text and JSON reports of admission runs, the matrix table, and the frontier plot."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchlib.admission import (
    TARGET_MAX_OVER_OWN,
    TARGET_P99_OVER_OWN,
    TARGET_TTFT_RATIO,
    AdmissionResult,
)


def to_jsonable(value: Any) -> Any:
    """Dataclasses as dicts, NaN as None (strict JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _num(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def format_run(r: AdmissionResult) -> str:
    """One run as markdown tables."""
    params = " ".join(f"{k}={v}" for k, v in r.params.items()) or "defaults"
    q, a, post = r.quiet_pooled, r.admission_pooled, r.post_pooled
    shared = f", {r.shared_prefix_tokens} of them a shared system prompt, " \
        f"{r.prompt_cached_tokens} served from the prefix cache" if r.shared_prefix_tokens else ""
    lines = [f"policy {r.policy} ({params}); {r.streams} streams; prompt {r.prompt_tokens} "
             f"tokens{shared}; chunk {r.chunk_tokens}; {r.max_running} running", "",
             "| metric | value |", "|---|---|",
             f"| TTFT admitted | {_num(r.ttft_s)} s |",
             f"| TTFT alone (idle server) | {_num(r.ttft_alone_s)} s |",
             f"| TTFT / TTFT alone | {_num(r.ttft_ratio)}x |",
             f"| quiet ITL p50 / p95 (pooled) | {_num(q.p50_ms)} / {_num(q.p95_ms)} ms |",
             f"| admission ITL p50 / p95 (pooled) | {_num(a.p50_ms)} / {_num(a.p95_ms)} ms |",
             f"| admission ITL p99 / max (pooled) | {_num(a.p99_ms)} / {_num(a.max_ms)} ms |",
             f"| admission p95 inflation | {_num(r.p95_inflation)}x |",
             f"| after the first token: ITL p50 / p95 | {_num(post.p50_ms)} / "
             f"{_num(post.p95_ms)} ms |",
             f"| streams' own p95 (larger of quiet and after) | {_num(r.own_p95_ms)} ms |",
             f"| admission p99 / own p95 (target <= {TARGET_P99_OVER_OWN:g}) | "
             f"{_num(r.p99_over_own)}x |",
             f"| admission max / own p95 (target <= {TARGET_MAX_OVER_OWN:g}) | "
             f"{_num(r.max_over_own)}x |",
             f"| work-conserving limit of TTFT / alone | {_num(r.work_conserving_limit)}x |",
             f"| first token before last stream token | "
             f"{'yes' if r.first_token_before_last_stream_token else 'no'} |",
             f"| quiet decode throughput | {_num(r.quiet_tokens_per_s, 0)} tokens/s |",
             f"| prompt chunks (beside live streams) | {r.prompt_chunks} "
             f"({r.prompt_chunks_while_streams_live}) |",
             *[f"| {kind} ticks over their latency target: > 1x / > 1.25x | "
               f"{_num(100 * t['over_1'], 0)}% / {_num(100 * t['over_1.25'], 0)}% of "
               f"{t['ticks']:.0f} |" for kind, t in r.over_target.items() if t["ticks"]], "",
             "| stream | quiet gaps | quiet p50 ms | quiet p95 ms | adm gaps | adm p50 ms "
             "| adm p95 ms | adm max ms |", "|---|---|---|---|---|---|---|---|"]
    for i, (qs, ad) in enumerate(zip(r.quiet, r.admission, strict=True)):
        lines.append(f"| {i} | {qs.num_gaps} | {_num(qs.p50_ms)} | {_num(qs.p95_ms)} | "
                     f"{ad.num_gaps} | {_num(ad.p50_ms)} | {_num(ad.p95_ms)} | "
                     f"{_num(ad.max_ms)} |")
    counters = ", ".join(f"{k.removeprefix('fairtick_')} {v:.0f}"
                         for k, v in sorted(r.counters.items()))
    rules = ", ".join(f"{k}: {v}" for k, v in sorted(r.grants_by_rule.items())) or "none"
    lines += ["", f"counter deltas over the admission window: {counters}",
              f"grants by rule: {rules}", *[f"note: {n}" for n in r.notes]]
    return "\n".join(lines)


# (header, value of one run) for each column of the matrix table
COLUMNS: list[tuple[str, Callable[[AdmissionResult], float]]] = [
    ("TTFT s", lambda r: r.ttft_s),
    ("TTFT alone s", lambda r: r.ttft_alone_s),
    ("TTFT / alone", lambda r: r.ttft_ratio),
    ("quiet p95 ms", lambda r: r.quiet_pooled.p95_ms),
    ("adm p50 ms", lambda r: r.admission_pooled.p50_ms),
    ("adm p95 ms", lambda r: r.admission_pooled.p95_ms),
    ("p95 inflation", lambda r: r.p95_inflation),
    ("adm p99 ms", lambda r: r.admission_pooled.p99_ms),
    ("adm max ms", lambda r: r.admission_pooled.max_ms),
    ("own p95 ms", lambda r: r.own_p95_ms),
    ("p99 / own", lambda r: r.p99_over_own),
    ("max / own", lambda r: r.max_over_own),
    ("WC limit", lambda r: r.work_conserving_limit),
    ("quiet tokens/s", lambda r: r.quiet_tokens_per_s),
    ("mixed ticks > target", lambda r: r.over_target.get("mixed", {}).get("over_1", math.nan)),
    ("probe ticks > target", lambda r: r.over_target.get("probe", {}).get("over_1", math.nan)),
    ("prompt cached tokens", lambda r: r.prompt_cached_tokens),
]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the defined values; NaNs when none is."""
    ok = [v for v in values if v is not None and not math.isnan(v)]
    if not ok:
        return math.nan, math.nan, math.nan
    return statistics.median(ok), min(ok), max(ok)


def _cell(values: Sequence[float]) -> str:
    med, lo, hi = spread(values)
    if math.isnan(med):
        return "n/a"
    digits = 0 if med >= 100 else 1 if med >= 10 else 2
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


@dataclasses.dataclass
class ArmRuns:
    """The runs of one arm: results of comparable runs, reasons of the others."""

    label: str
    policy: str
    flags: list[str]
    results: list[AdmissionResult] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)


def meets_target(r: AdmissionResult) -> bool:
    """The issue's three figures in one run: p99 and max against the streams' own p95, TTFT
    against TTFT alone."""
    return (r.p99_over_own <= TARGET_P99_OVER_OWN and r.max_over_own <= TARGET_MAX_OVER_OWN
            and r.ttft_ratio <= TARGET_TTFT_RATIO)


def format_matrix(arms: Sequence[ArmRuns]) -> str:
    """Medians [min, max] over each arm's comparable runs, one row per arm."""
    head = ["arm", *[c for c, _ in COLUMNS], "first < last stream token", "meets target",
            "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        n = len(arm.results)
        cells = [_cell([f(r) for r in arm.results]) for _, f in COLUMNS]
        before = sum(r.first_token_before_last_stream_token for r in arm.results)
        runs = f"{n} ok" + (f", {len(arm.refused)} NOT COMPARABLE" if arm.refused else "")
        meets = f"{sum(meets_target(r) for r in arm.results)}/{n}"
        lines.append("| " + " | ".join([arm.label, *cells, f"{before}/{n}", meets, runs])
                     + " |")
    refusals = [f"- {a.label}: {a.refused.count(why)}x NOT COMPARABLE: {why}"
                for a in arms for why in dict.fromkeys(a.refused)]
    return "\n".join(lines + ([""] + refusals if refusals else []))


def plot_frontier(arms: Sequence[ArmRuns], path: Path, title: str) -> None:
    """TTFT / TTFT alone against admission-window ITL p99 / the streams' own p95, one point
    (median, with [min, max] bars) per arm with comparable runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 6), dpi=100)
    for arm in arms:
        xs = spread([r.p99_over_own for r in arm.results])
        ys = spread([r.ttft_ratio for r in arm.results])
        if math.isnan(xs[0]) or math.isnan(ys[0]):
            continue
        ax.errorbar(xs[0], ys[0], xerr=[[xs[0] - xs[1]], [xs[2] - xs[0]]],
                    yerr=[[ys[0] - ys[1]], [ys[2] - ys[0]]], fmt="o", capsize=3)
        ax.annotate(arm.label, (xs[0], ys[0]), textcoords="offset points", xytext=(6, 6),
                    fontsize=8)
    ax.axvline(TARGET_P99_OVER_OWN, color="grey", linestyle="--", linewidth=1)
    ax.axhline(TARGET_TTFT_RATIO, color="grey", linestyle="--", linewidth=1,
               label=f"target: p99 <= {TARGET_P99_OVER_OWN:g}x own p95, TTFT <= "
               f"{TARGET_TTFT_RATIO:g}x alone")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        axis.set_major_formatter(plain)  # minor ticks labelled only on short ranges
        axis.set_minor_formatter(plain if math.log10(hi / lo) < 1.5 else NullFormatter())
    ax.set_xlabel("admission-window ITL p99 / streams' own p95 (lower is better)")
    ax.set_ylabel("TTFT / TTFT alone (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
