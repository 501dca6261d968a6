"""Measured step costs on this machine: verify and draft forward time as a function of batch and width,
plus the rest of a scheduler step (sampling, acceptance, bookkeeping), with and without a draft call.

Filled by a short calibration at session start (``auto`` speculation) and refined online from
every forward the scheduler runs (the median of the last few measurements per point, so one step
stalled by a GC pause or a busy core does not move the estimate; the least of them while a point has fewer
than ``_TRUSTED``: noise only ever adds time, and a point's first measurement is often a cold one). Lookups
between measured points interpolate linearly in width and batch; outside them they extrapolate from the
nearest edge.

The policy compares points measured at very different rates: a plain step at the serving batch size is
measured every step, a wide verify at that size only when something drafts. So calibration is read as the
*shape* of the costs and traffic as their current *scale*: a calibrated point without ``_TRUSTED`` online
measurements of its own costs its calibration time times the drift, the median ratio of online to calibrated
time over the points of its kind and batch size that have them (of its kind at the nearest batch size while
its own has none): the machine got busier, the served contexts are longer than the calibration's, and a
forward run between forwards of the other network runs slower than the same forward repeated (on a 2-core
CPU, ONNX Runtime: online / calibrated 1.6-2.2x for verify, 2.3-3.4x for draft). The decision then rests
on ratios measured in traffic on this machine, not on how fast it was when the session started.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass

_WINDOW = 9
"""Measurements per point the estimate is the median of."""
_HISTORY = 4096
"""Measurements per point kept for reports (:meth:`CostModel.breakdown` over a span of traffic)."""
_TRUSTED = 3
"""Online measurements a point needs before its own median replaces its (drift-scaled) calibration time."""


@dataclass(frozen=True)
class StepCosts:
    """Where a step's time goes at one batch size, in seconds: the forwards and the rest of the step.

    ``plain_step`` is a plain decoding step (verify of 1 token + its other work); ``cycle`` a draft-verify
    cycle with ``draft_len`` drafts per row (draft of ``draft_len + 1`` + verify of ``draft_len + 1`` + its
    other work). A cycle commits τ tokens per row (τ includes the bonus), a plain step one, so the speed-up
    these costs imply is ``τ · plain_step / cycle`` (docs/algorithm.md §6): what the forwards allow, before prefill,
    the batch shrinking at the end of a wave, and scheduling.
    """

    batch: int
    draft_len: int
    plain_verify: float  # target forward of 1 token per row
    plain_other: float  # the rest of a plain step: sampling, bookkeeping, handing tokens over
    verify: float  # target forward of draft_len + 1 tokens per row
    draft: float  # draft forward of a draft_len + 1 block per row
    draft_other: float  # the rest of a drafting step

    @property
    def plain_step(self) -> float:
        return self.plain_verify + self.plain_other

    @property
    def cycle(self) -> float:
        return self.verify + self.draft + self.draft_other

    def ideal_speedup(self, tau: float) -> float:
        """``τ · plain_step / cycle``: tokens per second of drafting over plain decoding at these costs."""
        return tau * self.plain_step / self.cycle

    def to_dict(self) -> dict[str, float | int]:
        return {"batch": self.batch, "draft_len": self.draft_len, "plain_verify_s": self.plain_verify,
                "plain_other_s": self.plain_other, "plain_step_s": self.plain_step, "verify_s": self.verify,
                "draft_s": self.draft, "draft_other_s": self.draft_other, "cycle_s": self.cycle}


class CostModel:
    """Seconds per forward, keyed by (batch size, tokens per row)."""

    def __init__(self) -> None:
        # online estimate per point: the median of its last measurements (read through ``_value``)
        self.table: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}
        self.calibrated: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}  # the grid
        # drafting step? -> batch size -> seconds of a step outside the forwards (per-request Python work
        # grows with the batch, so one number for all sizes would misprice batch 1 and batch 64 alike)
        self.overheads: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self._ratios: dict[tuple[str, int], dict[int, float]] = {}  # (kind, batch) -> width -> online/calibrated
        self._drifts: dict[str, dict[int, float]] = {"verify": {}, "draft": {}}  # kind -> batch -> median ratio
        self._samples: dict[tuple, deque[float]] = {}
        self._history: dict[tuple, deque[float]] = {}  # longer record per point, for reports only
        self._counts: dict[tuple, int] = {}  # measurements ever recorded per point (marks index into history)
        # lookups run several times per scheduler step, so what they search is kept sorted and small:
        self._layout: dict[str, tuple[list[int], dict[int, list[int]]] | None] = {"verify": None, "draft": None}

    def record_overhead(self, drafting: bool, batch: int, seconds: float) -> None:
        """One step's time outside its forwards. Nothing calibrates overheads, so a batch size counts as
        measured only from its ``_TRUSTED``-th step on: a session's first drafting step at batch 1 took 9 ms
        outside the forwards (first calls into the drafting code) where later ones took 0.7 ms, and that one
        sample alone made drafting look hopeless."""
        sample_key = ("overhead", drafting, batch)
        estimate = self._measured(sample_key, seconds)
        if self._counts[sample_key] >= _TRUSTED:
            self.overheads[drafting][batch] = estimate

    def _measured(self, sample_key: tuple, seconds: float) -> float:
        """Keep one measurement; return the point's estimate: the median of its last ``_WINDOW``, the least
        of them while it has fewer than ``_TRUSTED``."""
        samples = self._samples.setdefault(sample_key, deque(maxlen=_WINDOW))
        self._history.setdefault(sample_key, deque(maxlen=_HISTORY)).append(seconds)
        self._counts[sample_key] = self._counts.get(sample_key, 0) + 1
        samples.append(seconds)
        return statistics.median(samples) if len(samples) >= _TRUSTED else min(samples)

    def overhead(self, drafting: bool, batch: int) -> float:
        """Step time outside the forwards at this batch size (0 until measured). A drafting step is assumed
        no cheaper than a plain one; at a batch size where no drafting step ran yet, it is this size's plain
        overhead plus what drafting added at the nearest sizes where both ran (interpolated between them):
        a plain step's overhead at the serving size is measured from its first steps, while borrowing the
        drafting overhead measured at batch 1 priced batch-16 drafting steps at 0.7 ms that took 2-2.7 ms."""
        plain = self._overhead_at(False, batch)
        if not drafting:
            return plain
        measured, plains = self.overheads[True], self.overheads[False]
        both = sorted(b for b in measured if b in plains)
        if batch in measured or not both:
            return max(self._overhead_at(True, batch), plain)
        return plain + max(_clamped(both, batch, lambda b: measured[b] - plains[b]), 0.0)

    def _overhead_at(self, drafting: bool, batch: int) -> float:
        table = self.overheads[drafting]
        if len(table) <= 1:  # nothing or one size measured: assume it holds at every size
            return next(iter(table.values()), 0.0)
        return table[batch] if batch in table else _interpolate(sorted(table), batch, table.__getitem__)

    def step(self, batch: int, drafting: int, draft_len: int, context: int = 0) -> float:
        """Predicted seconds of one step: verify of ``draft_len + 1`` tokens per row, a draft call for
        ``drafting`` rows when ``draft_len > 0``, and the step's own overhead. ``context``: the most context
        taps a drafting row still has to take in (a whole prompt on its first draft), priced like block
        tokens, which over-states them (they skip the MLPs): a conservative estimate."""
        if draft_len == 0:
            return self.verify(batch, 1) + self.overhead(False, batch)
        return (self.verify(batch, draft_len + 1) + self.draft(drafting, draft_len + 1 + context)
                + self.overhead(True, batch))

    def mark(self) -> dict[tuple, int]:
        """A point in the traffic: :meth:`breakdown` ``since`` it prices only forwards measured after it."""
        return dict(self._counts)

    def breakdown(self, batch: int, draft_len: int, since: dict[tuple, int] | None = None) -> StepCosts:
        """A plain step and a ``draft_len`` cycle at ``batch`` rows (every row drafting), for reports.

        ``since`` (a :meth:`mark`): each part is the mean of that point's measurements after the mark (up to the
        last few thousand), where there are any: a mean, like a throughput, pays for every stalled step.
        Otherwise, and without ``since``, the current (median) estimate.
        Raises ``LookupError`` until verify and draft forwards were measured."""
        def part(sample_key: tuple, estimate) -> float:
            if since is not None:
                fresh = self._counts.get(sample_key, 0) - since.get(sample_key, 0)
                history = list(self._history.get(sample_key, ()))[-fresh:] if fresh > 0 else []
                if history:
                    return statistics.fmean(history)
            return estimate()

        width = draft_len + 1
        return StepCosts(batch, draft_len, part(("verify", batch, 1), lambda: self.verify(batch, 1)),
                         part(("overhead", False, batch), lambda: self.overhead(False, batch)),
                         part(("verify", batch, width), lambda: self.verify(batch, width)),
                         part(("draft", batch, width), lambda: self.draft(batch, width)),
                         part(("overhead", True, batch), lambda: self.overhead(True, batch)))

    def calibrate(self, kind: str, batch: int, width: int, seconds: float) -> None:
        """A calibration grid point: the shape of the costs, scaled by the drift until traffic measures it."""
        if (batch, width) not in self.calibrated[kind] and (batch, width) not in self.table[kind]:
            self._layout[kind] = None
        self.calibrated[kind][(batch, width)] = seconds
        self._refresh_drift(kind, (batch, width))

    def record(self, kind: str, batch: int, width: int, seconds: float) -> None:
        """One forward measured in traffic."""
        key = (batch, width)
        if key not in self.table[kind] and key not in self.calibrated[kind]:
            self._layout[kind] = None
        self.table[kind][key] = self._measured((kind, batch, width), seconds)
        self._refresh_drift(kind, key)

    def _refresh_drift(self, kind: str, key: tuple[int, int]) -> None:
        calibrated = self.calibrated[kind].get(key)
        if calibrated and self._counts.get((kind, *key), 0) >= _TRUSTED:
            ratios = self._ratios.setdefault((kind, key[0]), {})
            ratios[key[1]] = self.table[kind][key] / calibrated
            self._drifts[kind][key[0]] = statistics.median(ratios.values())

    def drift(self, kind: str, batch: int) -> float:
        """Online / calibrated time of ``kind`` forwards at this batch size, else at the nearest batch size
        where traffic measured one (the larger on a tie), else the other network's; 1 before any."""
        for drifts in (self._drifts[kind], self._drifts["draft" if kind == "verify" else "verify"]):
            if drifts:
                return drifts[min(drifts, key=lambda b: (abs(b - batch), -b))]
        return 1.0

    def _value(self, kind: str, key: tuple[int, int]) -> float:
        """A point's estimate: its online median once trusted (or where it was never calibrated), else its
        calibration time times the drift at its batch size."""
        calibrated = self.calibrated[kind].get(key)
        if calibrated is None or (key in self.table[kind] and self._counts[(kind, *key)] >= _TRUSTED):
            return self.table[kind][key]
        return calibrated * self.drift(kind, key[0])

    def verify(self, batch: int, width: int) -> float:
        return self._lookup("verify", batch, width)

    def draft(self, batch: int, width: int) -> float:
        return self._lookup("draft", batch, width) if batch else 0.0

    @staticmethod
    def draft_len_candidates(max_len: int) -> list[int]:
        """Draft lengths the auto policy considers: 0, powers of two minus one, and the maximum."""
        candidates = {0, max_len}
        k = 1
        while k < max_len:
            candidates.add(k)
            k = k * 2 + 1
        return sorted(candidates)

    def _lookup(self, kind: str, batch: int, width: int) -> float:
        """Interpolated cost, bounded by the monotone envelope: a forward with fewer rows or fewer tokens per
        row is never predicted slower than a larger calibration point (one noisy measurement cannot make plain
        decoding look expensive and lock the policy into drafting)."""
        if not self.table[kind] and not self.calibrated[kind]:
            raise LookupError(f"no {kind} costs measured yet; calibrate first")
        def value(key: tuple[int, int]) -> float:
            return self._value(kind, key)

        if (batch, width) in self.table[kind] or (batch, width) in self.calibrated[kind]:
            estimate = value((batch, width))
        else:
            batches, widths = self._sorted_keys(kind)
            estimate = _interpolate(batches, batch, lambda b: _interpolate(widths[b], width, lambda w: value((b, w))))
        larger = [value(key) for key in (self.calibrated[kind] or self.table[kind])
                  if key[0] >= batch and key[1] >= width]
        return min([estimate, *larger])

    def _sorted_keys(self, kind: str) -> tuple[list[int], dict[int, list[int]]]:
        """Measured batch sizes, and the widths measured at each, sorted (rebuilt only when a key is new)."""
        layout = self._layout[kind]
        if layout is None:
            widths: dict[int, set[int]] = {}
            for b, w in (*self.table[kind], *self.calibrated[kind]):
                widths.setdefault(b, set()).add(w)
            layout = self._layout[kind] = (sorted(widths), {b: sorted(ws) for b, ws in widths.items()})
        return layout


def _interpolate(points: list[int], x: int, value) -> float:
    """Piecewise-linear through ``(p, value(p))``; linear extrapolation from the two nearest edge points."""
    if len(points) == 1:
        return value(points[0]) * (x / points[0] if x > points[0] else 1.0)
    index = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
    low, high = points[index - 1], points[index]
    v_low, v_high = value(low), value(high)
    estimate = v_low + (v_high - v_low) * (x - low) / (high - low)
    return max(estimate, min(v_low, v_high) * 0.5)


def _clamped(points: list[int], x: int, value) -> float:
    """Piecewise-linear through ``(p, value(p))``, held constant beyond the edge points (no extrapolation)."""
    if x <= points[0]:
        return value(points[0])
    if x >= points[-1]:
        return value(points[-1])
    index = bisect.bisect_left(points, x)
    low, high = points[index - 1], points[index]
    return value(low) + (value(high) - value(low)) * (x - low) / (high - low)
