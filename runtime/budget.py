"""Online cost model of a tick: its seconds predicted from what it runs, learned as it runs.

A tick is one forward over decode rows and prefill slices (runtime/fused.py), then sampling and
publishing. Its time is modelled as a sum of non-negative costs, each tied to one kind of work:

    fixed + per_slice * slices + per_row * rows + per_token * slice_tokens
          + per_row_key * row_keys + per_attended * sum(t * (c + (t + 1) / 2))
          + per_constrained_row * constrained_rows

where a decode row costs its share of the projections and MLP plus its sampling and publishing,
a slice token only its share of the projections and MLP, `row_keys` is the (row, key) pairs the
decode rows attend (in a padded batch each row as many keys as the longest; runtime/row_groups.py
splits off rows far longer than the rest), a slice of t tokens at context c attends
c + 1 .. c + t keys per token, and a constrained row (one a grammar masks: runtime/grammar.py)
adds the mask's computation and application. The coefficients are refitted by non-negative
least squares, weighted for relative error, over the most recent ticks with slices and without
(kept apart, so a long run of decode-only ticks does not push the slice ticks out).

The slice that fits a target is the largest whose prediction, times the 0.95-quantile of
measured/predicted over the last 64 ticks with slices of the last 5 s (at least the last 8;
under the current fit), stays within it: the machine's noise around the model now sets the
margin, and the streams' p99 gap is what it must hold (with the 0.9-quantile over 32 ticks,
ticks ran to 1.2-1.3x their target at p99). Without the 5 s, a server's first tiny slice ticks
beside one stream (measured at 2-3x their prediction) held the margin at ~3 through a quiet
spell and the next admission's first 45 ticks to 1-token slices. A slice is also never larger
than a recent slice tick next to decode rows says would have fitted: its slice's tokens times
what its target left after the decode rows' predicted part over what the slice took after it
(at most twice), the largest of the last 32. So slices start small and a model that errs
(fitted on few-token slices, or misled by noise) grows them only by what measured ticks left
room for: doubling a slice that had used 97% of its target ran the next tick to 1.8x it. The
bound comes to the largest slice that fits from below (the slice's share is not all cost per
token), and "recent", because a prompt's context grows: a 200-token slice that fitted at
context 0 says nothing about one at context 8,000.

The target itself is stated in the decode rows' own step (runtime/tick_budget.py): its p95 measured
before a prompt was parked (`CostModel.decode_step_p95_s`), times how much slower the rows'
step has grown since (`DecodePace`, measured by probes while the prompt is parked).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.row_groups import attended_pairs

_REFIT_EVERY = 4  # ticks with slices between least-squares fits (a fit takes ~0.5-1 ms)
# Decode-only ticks between fits. Their fit sizes no slice until a prompt comes, and the decode
# step's target comes from measured steps (once 8 are alike), not the fit; fitting every 4 of
# them cost ~4% of a 4-row decode step (0.2 of ~5 ms) while streams decode alone.
_REFIT_EVERY_DECODE_ONLY = 32
_MARGIN_QUANTILE = 0.95  # of measured/predicted, over recent ticks with slices
_MARGIN_TICKS = 64  # the recent ticks with slices that the margin is taken over
_MARGIN_FRESH_S = 5.0  # ... of the last seconds (at least the last _MARGIN_MIN_SAMPLES of them)
_ROOM_TICKS = 32  # the recent slice ticks whose measured room caps the next slice
_MARGIN_MIN_SAMPLES = 8
_DECODE_QUANTILE = 0.95  # of measured/predicted, over recent decode-only ticks
_STEP_TICKS = 512  # the recent decode-only ticks whose p95 is the decode step's


@dataclass(frozen=True)
class SliceShape:
    """A prefill slice: `num_tokens` prompt tokens after `context` tokens already cached."""

    num_tokens: int
    context: int


@dataclass(frozen=True)
class TickShape:
    """What one tick runs, as the cost model sees it."""

    decode_contexts: tuple[int, ...] = ()  # cached tokens of each decode row
    slices: tuple[SliceShape, ...] = ()
    constrained_rows: int = 0  # sampled rows (decode rows, ended prompts) a grammar masks

    @property
    def is_empty(self) -> bool:
        return not self.decode_contexts and not self.slices

    def features(self) -> np.ndarray:
        rows = len(self.decode_contexts)
        row_keys = attended_pairs([c + 1 for c in self.decode_contexts])
        out = np.array([1.0, 0.0, rows, 0.0, row_keys, 0.0, self.constrained_rows])
        for s in self.slices:
            out += slice_features(s.num_tokens, s.context)
        return out


def slice_features(num_tokens: int, context: int) -> np.ndarray:
    """What one slice of `num_tokens` prompt tokens after `context` cached adds to a tick's
    features: one slice, its tokens, and the keys they attend (c + 1 .. c + t)."""
    return np.array([0.0, 1.0, 0.0, num_tokens, 0.0,
                     num_tokens * (context + (num_tokens + 1) / 2), 0.0])


@dataclass(frozen=True)
class TickRecord:
    """One observed tick: the prediction made before it ran (None before any fit), what it
    measured, and the target it was sized for (None when no slice was sized)."""

    shape: TickShape
    predicted_s: float | None
    measured_s: float
    target_s: float | None


class DecodePace:
    """How much slower the decode rows' step runs now than when a prompt was parked beside them.

    While a prompt is parked every tick carries one of its slices, so no decode-only tick
    measures the streams' own step, and that step slows as their contexts grow (a decode row
    reads its whole cache every step). So `probe` ticks run the decode rows in a forward of
    their own, timed: the first `baseline` ticks of a parked run (the streams' pace when the
    prompt came) and then one in every `every`. `growth` is the median of the last `recent`
    probes over the median of the baseline ones (at least 1), for the same rows; new rows, or a
    tick without a parked prompt in between, start a new baseline. The probes' own overhead (an
    unfused forward) cancels in the ratio. The probes time the machine too, so load that comes
    while a prompt is parked would raise the growth as a longer context does; the growth is
    therefore never more than the rows' context explains: the keys they attend now over then
    (a step that costs a + b * keys, a and b >= 0, grows by at most the keys' ratio).
    """

    def __init__(self, every: int = 16, baseline: int = 5, recent: int = 5) -> None:
        if every < 1 or baseline < 1 or recent < 1:
            raise ValueError(f"every, baseline and recent must be >= 1, got {every}, "
                             f"{baseline}, {recent}")
        self.every, self.baseline = every, baseline
        self._rows: tuple[int, ...] = ()
        self._tick = -2  # the last parked tick seen
        self._baseline: list[tuple[float, int]] = []  # (seconds, keys) of each probe
        self._recent: deque[tuple[float, int]] = deque(maxlen=recent)
        self._since = 0  # parked ticks since the last probe
        self._growth: float | None = None  # until the next probe or a new baseline

    def due(self, rows: Sequence[int], tick: int) -> bool:
        """Whether parked tick `tick`, whose decode rows are the sequences `rows`, is a probe;
        call once per parked tick, in tick order."""
        rows = tuple(rows)
        if rows != self._rows or tick != self._tick + 1:
            self._rows, self._baseline, self._since, self._growth = rows, [], 0, None
            self._recent.clear()
        self._tick = tick
        self._since += 1
        if len(self._baseline) < self.baseline or self._since >= self.every:
            self._since = 0
            return True
        return False

    def observe(self, rows: Sequence[int], seconds: float, keys: int) -> None:
        """The probe of decode rows `rows`, attending `keys` keys in all, took `seconds`."""
        if tuple(rows) != self._rows or not seconds > 0 or keys < 1:
            return
        if len(self._baseline) < self.baseline:
            self._baseline.append((seconds, keys))
        else:
            self._recent.append((seconds, keys))
        self._growth = None

    def probe_s(self, rows: Sequence[int]) -> float | None:
        """What a probe's forward of `rows` alone takes now: the median of the last `recent`
        probes (of the baseline ones before any later); None before the first probe."""
        if tuple(rows) != self._rows:
            return None
        probes = self._recent or self._baseline
        return float(np.median([seconds for seconds, _ in probes])) if probes else None

    def growth(self, rows: Sequence[int]) -> float:
        """The decode step of `rows` now over when their parked run began (1 until measured)."""
        if tuple(rows) != self._rows or len(self._baseline) < self.baseline or \
                not self._recent:
            return 1.0
        if self._growth is None:
            now, then = np.median(list(self._recent), axis=0), np.median(self._baseline, axis=0)
            self._growth = max(1.0, float(min(now[0] / then[0], now[1] / then[1])))
        return self._growth


class CostModel:
    """What ticks cost on this machine, learned from the ticks the engine runs."""

    def __init__(self, window: int = 128, history: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window < 8 or history < 1:
            raise ValueError(f"window must be >= 8 and history >= 1, got {window}, {history}")
        self._clock = clock
        self._with_slices: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._slice_times: deque[float] = deque(maxlen=window)  # when each was observed
        self._without: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        # (rows, constrained rows, seconds) of the recent decode-only ticks, for their p95: a
        # longer window than the fit's, so a burst of noise a few dozen ticks long (a shared
        # machine's) does not make the p95.
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=_STEP_TICKS)
        # Their p95 by (rows, constrained rows), until the next decode-only tick: asked every
        # tick while a prompt is parked, when no decode-only tick runs.
        self._step_p95: dict[tuple[int, int], float] = {}
        self._coef: np.ndarray | None = None
        self._margin = 1.0
        self._since_fit = 0
        # Per recent slice tick next to decode rows: the slice its measurement says would have
        # fitted its target (`_room_tokens`).
        self._room: deque[int] = deque(maxlen=_ROOM_TICKS)
        # The observed ticks as plain tuples of numbers (`records` rebuilds them): CPython stops
        # tracking such a tuple, so Python's collections do not walk 4,096 records each time
        # (dataclass records were ~60% of the objects a server's collections walked). A tuple
        # of tuples built from a generator stayed tracked: the slices are kept flat.
        self._records: deque[tuple[Any, ...]] = deque(maxlen=history)

    @property
    def records(self) -> list[TickRecord]:
        """The last `history` observed ticks, oldest first."""
        return [TickRecord(TickShape(rows, tuple(SliceShape(*slices[i:i + 2])
                                                 for i in range(0, len(slices), 2)), constrained),
                           predicted, measured, target)
                for rows, slices, constrained, predicted, measured, target in self._records]

    def predict_s(self, shape: TickShape) -> float | None:
        """Predicted seconds of a tick that runs `shape`; None until something is measured."""
        if self._coef is None:
            return None
        return float(shape.features() @ self._coef)

    def observe(self, shape: TickShape, seconds: float, target_s: float | None = None) -> None:
        """Learn from one tick that ran `shape` in `seconds` (sized for `target_s`, if any)."""
        if shape.is_empty or not seconds > 0:
            return
        features = shape.features()  # once: this runs every tick
        predicted = None if self._coef is None else float(features @ self._coef)
        self._records.append((tuple(shape.decode_contexts),  # slices flat: a tuple of tuples
                              tuple(n for s in shape.slices for n in (s.num_tokens, s.context)),
                              shape.constrained_rows, predicted, seconds, target_s))
        if shape.slices and shape.decode_contexts and target_s is not None:
            self._room.append(self._room_tokens(shape, seconds, target_s))
        if shape.slices:
            self._with_slices.append((features, seconds))
            self._slice_times.append(self._clock())
        else:
            self._without.append((features, seconds))
            self._steps.append((len(shape.decode_contexts), shape.constrained_rows, seconds))
            self._step_p95.clear()
        self._since_fit += 1
        every = _REFIT_EVERY if shape.slices else _REFIT_EVERY_DECODE_ONLY
        if self._coef is None or self._since_fit >= every:
            self._fit()

    def decode_step_p95_s(self, decode_contexts: Sequence[int],
                          constrained_rows: int = 0) -> float | None:
        """The 95th percentile of a decode-only tick over these rows, as this machine runs it
        now: measured, over the recent decode-only ticks with as many rows (and constrained
        rows), when there are enough of them. The contexts those ticks had are not extrapolated
        to these rows': a quiet window spans a few hundred tokens of context, over which the
        fitted cost per key is noise (measured up to 5x off), and a target stated in a decode
        step that the fit inflates would grow while a long prompt prefills. Otherwise the
        model's prediction times the 0.95-quantile of measured / predicted over the recent
        decode-only ticks (the machine's tail, which a fit of the mean leaves out). None until
        something is measured."""
        key = (len(decode_contexts), constrained_rows)
        if key in self._step_p95:
            return self._step_p95[key]
        like = [seconds for rows, constrained, seconds in self._steps
                if (rows, constrained) == key]
        if len(like) >= _MARGIN_MIN_SAMPLES:
            self._step_p95[key] = float(np.quantile(like, _DECODE_QUANTILE))
            return self._step_p95[key]
        predicted = self.predict_s(TickShape(tuple(decode_contexts), (), constrained_rows))
        if predicted is None or self._coef is None:
            return predicted
        recent = list(self._without)
        if len(recent) < _MARGIN_MIN_SAMPLES:
            return predicted
        fitted = np.array([f for f, _ in recent]) @ self._coef
        ratios = np.array([s for _, s in recent]) / np.maximum(fitted, 1e-12)
        return predicted * max(1.0, float(np.quantile(ratios, _DECODE_QUANTILE)))

    def margin(self) -> float:
        """The factor predictions are scaled by when sizing a slice (1 until enough slices)."""
        return self._margin

    def slice_tokens_within(self, seconds: float, decode_contexts: Sequence[int],
                            context: int, most: int, constrained_rows: int = 0) -> int:
        """The most prompt tokens (<= `most`) that one slice at `context` can run next to the
        decode rows (`constrained_rows` of them masked by a grammar) in `seconds`; 0 while
        nothing has been measured."""
        coef = self._coef
        if coef is None:
            return 0
        margin = self.margin()
        # The decode rows' part of the prediction, the same for every slice size tried.
        rows_s = self.predict_s(TickShape(tuple(decode_contexts), (), constrained_rows)) or 0.0

        def fits(tokens: int) -> bool:
            return (rows_s + float(slice_features(tokens, context) @ coef)) * margin <= seconds

        low, high = 0, min(most, max(2, max(self._room, default=0)))
        while low < high:  # the largest that fits: predictions grow with the slice
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    def _room_tokens(self, shape: TickShape, seconds: float, target_s: float) -> int:
        # The slice this tick says would have fitted its target: its slice's tokens times what
        # the target leaves after the decode rows' predicted part over what the slice took
        # after it, at most doubled.
        tokens = max(s.num_tokens for s in shape.slices)
        rows_s = self.predict_s(TickShape(shape.decode_contexts, (), shape.constrained_rows)) or 0.0
        slice_s = seconds - rows_s
        if slice_s <= 0:
            return 2 * tokens
        return int(tokens * min(2.0, max(0.0, target_s - rows_s) / slice_s))

    def _fit(self) -> None:
        self._since_fit = 0
        samples = [*self._with_slices, *self._without]
        x = np.array([f for f, _ in samples])
        y = np.array([s for _, s in samples])
        # Weighted for relative error; columns scaled so no feature's units dominate.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        xw = x / scale / y[:, None]
        self._coef = _nonnegative_lstsq(xw, np.ones_like(y)) / scale
        recent = self._margin_ticks()
        if len(recent) >= _MARGIN_MIN_SAMPLES:
            fitted = np.array([f for f, _ in recent]) @ self._coef
            ratios = np.array([s for _, s in recent]) / np.maximum(fitted, 1e-12)
            self._margin = float(np.quantile(ratios, _MARGIN_QUANTILE))

    def _margin_ticks(self) -> list[tuple[np.ndarray, float]]:
        # The last _MARGIN_TICKS ticks with slices of the last _MARGIN_FRESH_S seconds, or the
        # last _MARGIN_MIN_SAMPLES if fewer (the module's docstring says why).
        ticks = list(self._with_slices)[-_MARGIN_TICKS:]
        times = list(self._slice_times)[-_MARGIN_TICKS:]
        since = self._clock() - _MARGIN_FRESH_S
        fresh = sum(t >= since for t in times)
        return ticks[-max(fresh, _MARGIN_MIN_SAMPLES):]


_ZERO = 1e-10  # a coefficient of the scaled problem this small is rounding: zero


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # argmin |a x - b| with every x >= 0 (Lawson and Hanson's active-set NNLS). A coefficient
    # whose true value is 0 can come out of the least squares as +1e-19 (numpy 2.4's lstsq
    # did, for the decode step's features of a fit of slice ticks alone): taken as zero, not
    # as a step that costs nothing.
    num = a.shape[1]
    passive, x = np.zeros(num, dtype=bool), np.zeros(num)
    for _ in range(3 * num):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= 1e-12:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, gradient)))] = True
        z = np.zeros(num)
        while passive.any():
            z = np.zeros(num)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            z[np.abs(z) <= _ZERO] = 0.0
            if z[passive].min() > 0:
                break
            # Step back to where the first coefficient reaches zero, and free it.
            bad = passive & (z <= 0)
            gap = x[bad] - z[bad]
            step = np.min(np.where(gap > 0, x[bad] / np.where(gap > 0, gap, 1.0), 0.0))
            x = x + step * (z - x)
            passive &= x > 1e-15
        x = np.where(passive, z, 0.0)
    return x
