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

For the same reason a point's own measurements expire: one not measured for ``_STALE_STEPS`` steps falls back
to its calibration times the current drift (a drafting overhead, to the plain step's plus what drafting added
where it was measured lately). Otherwise a burst of load on a shared machine while drafting leaves drafting
priced at the burst's cost: plain decoding, measured every step, recovers; drafting, priced too dear to be
tried, is never measured again (a c=1 session served 560 steps plainly on a 5 ms drafting overhead measured
during such a burst, where drafting steps took 0.7-1.3 ms outside their forwards before and after it).
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
_STALE_STEPS = 256
"""Scheduler steps after which a point's own measurements no longer count (it was not measured since)."""
_REVIEW_STEPS = 16
"""Steps between re-derivations of the drifts and of which points are stale (each measurement updates its own
point at once, and every point at once if it moved a calibrated point by over 10%; re-deriving every point at
every step cost ~0.1 ms of Python per step)."""


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
        # online estimate per point: the median of its last measurements (lookups read ``_estimate_table``)
        self.table: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}
        self.calibrated: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}  # the grid
        # drafting step? -> batch size -> seconds of a step outside the forwards (per-request Python work
        # grows with the batch, so one number for all sizes would misprice batch 1 and batch 64 alike)
        self.overheads: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self._steps = 0  # scheduler steps measured (one overhead each)
        self._last: dict[tuple, int] = {}  # the step of each point's last measurement
        # what lookups read (they run several times per scheduler step), re-derived every ``_REVIEW_STEPS``:
        self._estimates: dict[str, dict[tuple[int, int], float]] | None = None  # kind -> point -> seconds
        self._drafting_overheads: dict[int, float] | None = None  # batch -> seconds, the trusted ones
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
        self._steps += 1
        if self._steps % _REVIEW_STEPS == 0:
            self._estimates = self._drafting_overheads = None
        sample_key = ("overhead", drafting, batch)
        estimate = self._measured(sample_key, seconds)
        if self._trusted(sample_key):
            self.overheads[drafting][batch] = estimate
            if drafting and self._drafting_overheads is not None:
                self._drafting_overheads[batch] = estimate

    def _measured(self, sample_key: tuple, seconds: float) -> float:
        """Keep one measurement; return the point's estimate: the median of its last ``_WINDOW``, the least
        of them while it has fewer than ``_TRUSTED``."""
        samples = self._samples.setdefault(sample_key, deque(maxlen=_WINDOW))
        self._history.setdefault(sample_key, deque(maxlen=_HISTORY)).append(seconds)
        self._counts[sample_key] = self._counts.get(sample_key, 0) + 1
        if self._steps - self._last.get(sample_key, self._steps) > _STALE_STEPS:
            samples.clear()  # expired: the point starts over, its old measurements do not come back with it
        self._last[sample_key] = self._steps
        samples.append(seconds)
        return statistics.median(samples) if len(samples) >= _TRUSTED else min(samples)

    def overhead(self, drafting: bool, batch: int) -> float:
        """Step time outside the forwards at this batch size (0 until measured). A drafting step is assumed
        no cheaper than a plain one; at a batch size where no drafting step ran lately, it is this size's plain
        overhead plus what drafting added at the nearest sizes where both ran lately (interpolated between them):
        a plain step's overhead at the serving size is measured from its first steps, while borrowing the
        drafting overhead measured at batch 1 priced batch-16 drafting steps at 0.7 ms that took 2-2.7 ms."""
        plain = _overhead_at(self.overheads[False], batch)
        if not drafting:
            return plain
        plains = self.overheads[False]
        if self._drafting_overheads is None:
            self._drafting_overheads = {b: v for b, v in self.overheads[True].items()
                                        if self._trusted(("overhead", True, b))}
        measured = self._drafting_overheads
        both = sorted(b for b in measured if b in plains)
        if batch in measured or not both:
            return max(_overhead_at(measured, batch), plain)
        return plain + max(_clamped(both, batch, lambda b: measured[b] - plains[b]), 0.0)

    def _trusted(self, sample_key: tuple) -> bool:
        """Measured ``_TRUSTED`` times since it last expired, and lately (within ``_STALE_STEPS`` steps)."""
        return (len(self._samples.get(sample_key, ())) >= _TRUSTED
                and self._steps - self._last[sample_key] <= _STALE_STEPS)

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
        self._estimates = None

    def record(self, kind: str, batch: int, width: int, seconds: float) -> None:
        """One forward measured in traffic."""
        key = (batch, width)
        if key not in self.table[kind] and key not in self.calibrated[kind]:
            self._layout[kind] = None
        value = self.table[kind][key] = self._measured((kind, batch, width), seconds)
        if self._estimates is None or (key in self.calibrated[kind] and not self._trusted((kind, *key))):
            return
        before = self._estimates[kind].get(key)
        if key in self.calibrated[kind] and (before is None or abs(value - before) > 0.1 * before):
            self._estimates = None  # a drift moved: re-derive every point now
        else:
            self._estimates[kind][key] = value  # small moves reach the drifts at the next review

    def drifts(self) -> dict[str, dict[int, float]]:
        """Per kind and batch size: online / calibrated time, the median over the calibrated points traffic
        measured lately (trusted)."""
        drifts: dict[str, dict[int, float]] = {"verify": {}, "draft": {}}
        for kind, ratios in drifts.items():
            by_batch: dict[int, list[float]] = {}
            for key, calibrated in self.calibrated[kind].items():
                if key in self.table[kind] and self._trusted((kind, *key)):
                    by_batch.setdefault(key[0], []).append(self.table[kind][key] / calibrated)
            ratios.update({batch: statistics.median(values) for batch, values in by_batch.items()})
        return drifts

    def _estimate_table(self, kind: str) -> dict[tuple[int, int], float]:
        """Every point's estimate: its online median while trusted (or where it was never calibrated), else its
        calibration time times the drift of its kind at its batch size, else at the nearest batch size with one
        (the larger on a tie), else the other network's there; 1 before any."""
        if self._estimates is None:
            drifts, self._estimates = self.drifts(), {}
            for of, other in (("verify", "draft"), ("draft", "verify")):
                table, calibrated = self.table[of], self.calibrated[of]
                estimates = self._estimates[of] = {}
                for key in calibrated.keys() | table.keys():
                    if key not in calibrated or (key in table and self._trusted((of, *key))):
                        estimates[key] = table[key]
                    else:
                        near = drifts[of] or drifts[other]
                        drift = near[min(near, key=lambda b: (abs(b - key[0]), -b))] if near else 1.0
                        estimates[key] = calibrated[key] * drift
        return self._estimates[kind]

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
        estimates = self._estimate_table(kind)
        if (batch, width) in estimates:
            estimate = estimates[(batch, width)]
        else:
            batches, widths = self._sorted_keys(kind)
            estimate = _interpolate(batches, batch,
                                    lambda b: _interpolate(widths[b], width, lambda w: estimates[(b, w)]))
        larger = [estimates[key] for key in (self.calibrated[kind] or self.table[kind])
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


def _overhead_at(table: dict[int, float], batch: int) -> float:
    """A step overhead at ``batch`` from those measured at other sizes (0 if none)."""
    if len(table) <= 1:  # nothing or one size measured: assume it holds at every size
        return next(iter(table.values()), 0.0)
    return table[batch] if batch in table else _interpolate(sorted(table), batch, table.__getitem__)
