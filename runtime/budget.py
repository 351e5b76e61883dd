"""Online cost model of a tick, for policies that size prefill slices to a latency target.

A decode step's time is tracked per batch size (moving average). A prefill slice of t tokens
whose prompt already has c tokens in cache costs about o + a*t + b*t*c seconds (a fixed cost
per forward, the per-token matmuls, and attention over the context); o, a, b are refitted by
least squares over the most recent slices, so the model follows a long prompt's growing context.
"""

from __future__ import annotations

from collections import deque

import numpy as np

_ALPHA = 0.2  # weight of a new decode measurement in the moving average


class CostModel:
    """What ticks cost on this machine, learned from the ticks the engine runs."""

    def __init__(self, window: int = 48) -> None:
        self._decode_s: dict[int, float] = {}
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coef = (0.0, 0.0, 0.0)  # o, a, b
        self._since_fit = 0

    def observe_decode(self, batch: int, seconds: float) -> None:
        old = self._decode_s.get(batch)
        self._decode_s[batch] = seconds if old is None else old + _ALPHA * (seconds - old)

    def observe_prefill(self, tokens: int, context: int, seconds: float) -> None:
        self._samples.append((tokens, context, seconds))
        self._since_fit += 1
        if self._since_fit >= 4 or len(self._samples) <= 4:
            self._fit()

    def decode_s(self, batch: int) -> float | None:
        """Seconds of a decode step for `batch` sequences (nearest measured batch size)."""
        if not self._decode_s:
            return None
        nearest = min(self._decode_s, key=lambda b: (abs(b - batch), -b))
        return self._decode_s[nearest] * max(1.0, batch / nearest) ** 0.5

    def prefill_s(self, tokens: int, context: int) -> float:
        o, a, b = self._coef
        return o + a * tokens + b * tokens * context

    def prefill_tokens_within(self, seconds: float, context: int, most: int) -> int:
        """The most prompt tokens (<= `most`) a slice at `context` can run in `seconds`;
        0 while nothing has been measured."""
        if not self._samples:
            return 0
        o, a, b = self._coef
        per_token = a + b * context
        if per_token <= 0:
            return most
        return int(max(0, min(most, (seconds - o) / per_token)))

    def _fit(self) -> None:
        self._since_fit = 0
        data = np.array(self._samples, dtype=np.float64)
        t, c, s = data[:, 0], data[:, 1], data[:, 2]
        if len(data) < 4 or np.ptp(t) == 0 and np.ptp(c) == 0:
            self._coef = (0.0, float(np.mean(s / t)), 0.0)  # too little spread: per token only
            return
        # The fixed cost per forward can only be told apart from the per-token cost when the
        # slices differ in size (whole chunks alone make `1` and `t` collinear).
        with_fixed = t.max() >= 2 * t.min()
        columns = [np.ones_like(t)] if with_fixed else []
        features = np.stack([*columns, t, t * c], axis=1)
        coef = [max(0.0, float(x)) for x in np.linalg.lstsq(features, s, rcond=None)[0]]
        o, a, b = coef if with_fixed else (0.0, *coef)
        if a == 0.0 and b == 0.0:  # a degenerate fit: fall back to the mean per-token cost
            o, a = 0.0, float(np.mean(s / t))
        self._coef = (o, a, b)
