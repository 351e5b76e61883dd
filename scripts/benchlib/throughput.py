"""Steady decode throughput: the tokens of many streams that arrive in one time window."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from benchlib.windows import GapStats, Window, gaps_in, ratio


@dataclass(frozen=True)
class WindowRate:
    """What a set of streams produced inside one window."""

    tokens: int
    window_s: float
    active_streams: int  # streams with at least one token inside the window
    tokens_before: float  # mean tokens an active stream had before the window (its context)
    gaps: GapStats  # inter-token gaps wholly inside the window, over every stream

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s


def window_rate(times_s: Sequence[Sequence[float]], window: Window) -> WindowRate:
    """Tokens arriving in `window` (one arrival-time list per stream), summed over streams."""
    inside = [[t for t in times if window.start_s <= t < window.end_s] for times in times_s]
    active = [i for i, ts in enumerate(inside) if ts]
    before = [sum(1 for t in times_s[i] if t < window.start_s) for i in active]
    all_gaps = [g for times in times_s for g in gaps_in(times, window)]
    return WindowRate(tokens=sum(len(ts) for ts in inside),
                      window_s=window.end_s - window.start_s, active_streams=len(active),
                      tokens_before=statistics.fmean(before) if before else 0.0,
                      gaps=GapStats.of(all_gaps))


def token_window(times_s: Sequence[Sequence[float]], first: int, last: int) -> Window | None:
    """The window from when every stream has its `first`-th token to when the first stream has
    its `last`-th (1-based): inside it every stream decodes at a context between `first` and
    `last` tokens past its prompt. None if the streams drifted so far apart that no such window
    exists (one had its `last`-th token before another had its `first`-th)."""
    if not 0 < first < last:
        raise ValueError(f"need 0 < first < last, got {first}, {last}")
    if not times_s or any(len(times) < last for times in times_s):
        raise ValueError(f"every stream needs {last} tokens")
    start = max(times[first - 1] for times in times_s)
    end = min(times[last - 1] for times in times_s)
    return Window(start, end) if end > start else None


def arm_order(arms: Sequence[str], round_index: int) -> list[str]:
    """A B in even rounds, B A in odd ones: neither arm always runs first (or last)."""
    return list(arms) if round_index % 2 == 0 else list(arms)[::-1]


class HasRate(Protocol):
    @property
    def tokens_per_s(self) -> float: ...


def median_rate(rates: Sequence[HasRate]) -> float:
    """The median tokens/s of some runs; NaN for none."""
    return statistics.median(r.tokens_per_s for r in rates) if rates else math.nan


@dataclass(frozen=True)
class Comparison:
    """One stream count: the median rate of each arm and the ratios the issue sets goals for."""

    streams: int
    fairtick_tok_s: float
    mlx_lm_tok_s: float
    bare_tok_s: float
    bare_rows: int

    @property
    def vs_mlx_lm(self) -> float:
        return ratio(self.fairtick_tok_s, self.mlx_lm_tok_s)

    @property
    def vs_bare(self) -> float:
        return ratio(self.fairtick_tok_s, self.bare_tok_s)


def format_table(rows: Sequence[Comparison], goal_mlx_lm: float, goal_bare: float) -> str:
    """The results as a markdown table, each ratio beside its goal."""
    lines = [f"| streams | fairtick tok/s | mlx_lm.server tok/s | fairtick / mlx_lm.server "
             f"(goal >= {goal_mlx_lm:g}) | bare loop tok/s (rows) | fairtick / bare "
             f"(goal >= {goal_bare:g}) |", "|---|---|---|---|---|---|"]
    for c in rows:
        lines.append(f"| {c.streams} | {c.fairtick_tok_s:.0f} | {c.mlx_lm_tok_s:.0f} | "
                     f"{c.vs_mlx_lm:.2f} | {c.bare_tok_s:.0f} ({c.bare_rows}) | "
                     f"{c.vs_bare:.2f} |")
    return "\n".join(lines)
