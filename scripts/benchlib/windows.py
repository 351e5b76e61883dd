"""Inter-token gaps attributed to time windows, and their percentiles.

A gap is the time between two consecutive tokens of one stream. A gap belongs to the quiet
window only when it lies wholly inside it. A gap crossing an edge of the admission window
counts for it when most of the gap lies inside, and is excluded otherwise: a policy that stalls
decode through the admission makes every admission-caused gap cross an edge (the stall begins
a tick before the prompt is admitted or ends a tick after its first token), and excluding those
would hide the stall; a gap mostly outside is a neighbour's and stays out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """[start_s, end_s] on the client's monotonic clock."""

    start_s: float
    end_s: float


def gaps(times_s: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each inter-token gap."""
    return list(zip(times_s, times_s[1:], strict=False))


def gaps_in(times_s: Sequence[float], window: Window, mostly: bool = False) -> list[float]:
    """Durations of the gaps wholly inside `window`; with `mostly`, of those at least half
    inside it."""
    out = []
    for a, b in gaps(times_s):
        overlap = min(b, window.end_s) - max(a, window.start_s)
        inside = window.start_s <= a and b <= window.end_s
        if inside or (mostly and b > a and overlap >= (b - a) / 2):
            out.append(b - a)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class GapStats:
    """Percentiles of a set of gaps, in milliseconds."""

    num_gaps: int
    p50_ms: float
    p95_ms: float
    max_ms: float
    p99_ms: float = math.nan

    @classmethod
    def of(cls, gaps_s: Sequence[float]) -> GapStats:
        return cls(len(gaps_s), 1e3 * percentile(gaps_s, 50), 1e3 * percentile(gaps_s, 95),
                   1e3 * max(gaps_s) if gaps_s else math.nan, 1e3 * percentile(gaps_s, 99))


def ratio(num: float, den: float) -> float:
    """num / den, NaN when undefined."""
    if math.isnan(num) or math.isnan(den) or den <= 0:
        return math.nan
    return num / den
