"""Measured step costs on this machine: verify and draft forward time as a function of batch and width,
plus the rest of a scheduler step (sampling, acceptance, bookkeeping), with and without a draft call.

Filled by a short calibration at session start (``auto`` speculation) and refined online from
every forward the scheduler runs (exponential moving average). Lookups between measured points
interpolate linearly in width and batch; outside them they extrapolate from the nearest edge.
"""

from __future__ import annotations

import bisect

_EMA = 0.2


class CostModel:
    """Seconds per forward, keyed by (batch size, tokens per row)."""

    def __init__(self) -> None:
        self.table: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}
        self.overheads: dict[bool, float] = {}  # drafting step? -> seconds of a step outside the forwards

    def record_overhead(self, drafting: bool, seconds: float) -> None:
        old = self.overheads.get(drafting)
        self.overheads[drafting] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def overhead(self, drafting: bool) -> float:
        """Step time outside the forwards (0 until measured; a drafting step is assumed no cheaper)."""
        if drafting:
            return max(self.overheads.get(True, 0.0), self.overheads.get(False, 0.0))
        return self.overheads.get(False, 0.0)

    def step(self, batch: int, drafting: int, draft_len: int) -> float:
        """Predicted seconds of one step: verify of ``draft_len + 1`` tokens per row, a draft call for
        ``drafting`` rows when ``draft_len > 0``, and the step's own overhead."""
        if draft_len == 0:
            return self.verify(batch, 1) + self.overhead(False)
        return self.verify(batch, draft_len + 1) + self.draft(drafting, draft_len + 1) + self.overhead(True)

    def record(self, kind: str, batch: int, width: int, seconds: float) -> None:
        table = self.table[kind]
        key = (batch, width)
        table[key] = seconds if key not in table else (1 - _EMA) * table[key] + _EMA * seconds

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
        row is never predicted slower than a measured larger one (one noisy measurement cannot make plain
        decoding look expensive and lock the policy into drafting)."""
        table = self.table[kind]
        if not table:
            raise LookupError(f"no {kind} costs measured yet; calibrate first")
        batches = sorted({b for b, _ in table})
        estimate = (table[(batch, width)] if (batch, width) in table
                    else _interpolate(batches, batch, lambda b: self._at_batch(table, b, width)))
        larger = [t for (b, w), t in table.items() if b >= batch and w >= width]
        return min([estimate, *larger])

    @staticmethod
    def _at_batch(table: dict[tuple[int, int], float], batch: int, width: int) -> float:
        widths = sorted(w for b, w in table if b == batch)
        return _interpolate(widths, width, lambda w: table[(batch, w)])


def _interpolate(points: list[int], x: int, value) -> float:
    """Piecewise-linear through ``(p, value(p))``; linear extrapolation from the two nearest edge points."""
    if len(points) == 1:
        return value(points[0]) * (x / points[0] if x > points[0] else 1.0)
    index = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
    low, high = points[index - 1], points[index]
    v_low, v_high = value(low), value(high)
    estimate = v_low + (v_high - v_low) * (x - low) / (high - low)
    return max(estimate, min(v_low, v_high) * 0.5)
