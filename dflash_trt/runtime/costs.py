"""Measured step costs on this machine: verify and draft forward time as a function of batch and width,
plus the rest of a scheduler step (sampling, acceptance, bookkeeping), with and without a draft call.

Filled by a short calibration at session start (``auto`` speculation) and refined online from
every forward the scheduler runs (the median of the last few measurements per point, so one step
stalled by a GC pause or a busy core does not move the estimate). Lookups between measured points
interpolate linearly in width and batch; outside them they extrapolate from the nearest edge.
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
        self.table: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}
        # drafting step? -> batch size -> seconds of a step outside the forwards (per-request Python work
        # grows with the batch, so one number for all sizes would misprice batch 1 and batch 64 alike)
        self.overheads: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self._samples: dict[tuple, deque[float]] = {}
        self._history: dict[tuple, deque[float]] = {}  # longer record per point, for reports only
        self._counts: dict[tuple, int] = {}  # measurements ever recorded per point (marks index into history)
        # lookups run several times per scheduler step, so what they search is kept sorted and small:
        self._layout: dict[str, tuple[list[int], dict[int, list[int]]] | None] = {"verify": None, "draft": None}
        self._anchors: dict[str, list[tuple[int, int]]] = {"verify": [], "draft": []}  # the calibration grid

    def record_overhead(self, drafting: bool, batch: int, seconds: float) -> None:
        self._update(self.overheads[drafting], ("overhead", drafting, batch), batch, seconds)

    def _update(self, table: dict, sample_key: tuple, key, seconds: float) -> None:
        samples = self._samples.setdefault(sample_key, deque(maxlen=_WINDOW))
        self._history.setdefault(sample_key, deque(maxlen=_HISTORY)).append(seconds)
        self._counts[sample_key] = self._counts.get(sample_key, 0) + 1
        samples.append(seconds)
        table[key] = statistics.median(samples)

    def overhead(self, drafting: bool, batch: int) -> float:
        """Step time outside the forwards at this batch size (0 until measured; a drafting step is assumed
        no cheaper than a plain one)."""
        plain = self._overhead_at(False, batch)
        return max(self._overhead_at(True, batch), plain) if drafting else plain

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

    def record(self, kind: str, batch: int, width: int, seconds: float, anchor: bool = False) -> None:
        """One measured forward. ``anchor``: a calibration grid point, one the monotone envelope checks."""
        key = (batch, width)
        if key not in self.table[kind]:
            self._layout[kind] = None
        if anchor and key not in self._anchors[kind]:
            self._anchors[kind].append(key)
        self._update(self.table[kind], (kind, batch, width), key, seconds)

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
        table = self.table[kind]
        if not table:
            raise LookupError(f"no {kind} costs measured yet; calibrate first")
        if (batch, width) in table:
            estimate = table[(batch, width)]
        else:
            batches, widths = self._sorted_keys(kind)
            estimate = _interpolate(batches, batch,
                                    lambda b: _interpolate(widths[b], width, lambda w: table[(b, w)]))
        larger = [table[key] for key in (self._anchors[kind] or table) if key[0] >= batch and key[1] >= width]
        return min([estimate, *larger])

    def _sorted_keys(self, kind: str) -> tuple[list[int], dict[int, list[int]]]:
        """Measured batch sizes, and the widths measured at each, sorted (rebuilt only when a key is new)."""
        layout = self._layout[kind]
        if layout is None:
            widths: dict[int, list[int]] = {}
            for b, w in self.table[kind]:
                widths.setdefault(b, []).append(w)
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
