"""A long run's inter-token gaps: pooled percentiles out to p99.9, split by whether a prompt was
prefilling, and the worst gaps with when they happened.

A gap (between two consecutive tokens of one stream) is a prompt's when it overlaps the
prompt's life, from its request to its last token: a gap there may wait on the prompt's slices,
its joining the decode batch or its leaving it. Every other gap is the streams' own; their tail
is what the server's own work (a collection, the batch growing, a stream joining or leaving)
costs the streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchlib.windows import Window, percentile, ratio


@dataclass(frozen=True)
class Gap:
    start_s: float  # since the run began
    ms: float
    during_prompt: bool


@dataclass(frozen=True)
class TailStats:
    """Percentiles of a set of gaps, in milliseconds, out to p99.9."""

    num_gaps: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float

    @classmethod
    def of(cls, gaps: Sequence[Gap]) -> TailStats:
        ms = [g.ms for g in gaps]
        return cls(len(ms), percentile(ms, 50), percentile(ms, 95), percentile(ms, 99),
                   percentile(ms, 99.9), max(ms) if ms else float("nan"))

    @property
    def max_over_p95(self) -> float:
        return ratio(self.max_ms, self.p95_ms)

    @property
    def p999_over_p95(self) -> float:
        return ratio(self.p999_ms, self.p95_ms)


def classify_gaps(streams: Sequence[Sequence[float]], prompts: Sequence[Window],
                  t0_s: float) -> list[Gap]:
    """Every gap of every stream (a stream: one request's token times), marked when it overlaps
    a prompt's window [request sent, last token]."""
    out = []
    for times in streams:
        for a, b in zip(times, times[1:], strict=False):
            during = any(a < w.end_s and b > w.start_s for w in prompts)
            out.append(Gap(a - t0_s, 1e3 * (b - a), during))
    return out


def worst(gaps: Sequence[Gap], n: int) -> list[Gap]:
    """The n longest gaps, longest first."""
    return sorted(gaps, key=lambda g: g.ms, reverse=True)[:n]


def over(gaps: Sequence[Gap], threshold_ms: float) -> int:
    """How many gaps are longer than threshold_ms."""
    return sum(1 for g in gaps if g.ms > threshold_ms)
