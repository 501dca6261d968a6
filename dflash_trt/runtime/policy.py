"""Which draft length each request uses this step (0 = plain decoding): static rules or a cost model.

Static mode follows TensorRT-LLM's knobs: ``max_concurrency`` (no drafting above that many active
requests), ``draft_len_schedule`` (batch size -> draft length, a step function) and
``acceptance_rate_threshold`` over a rolling window. ``auto`` maximises expected tokens per second:

    E_r(k) = 1 + Σ_{i=1..k} Π_{j<=i} α_{r,j}        (expected committed tokens of request r, docs/algorithm.md §3.6)
    rate(k) = Σ_r E_r(k) / (cost_draft(B_k, k+1) + cost_verify(B, k+1) + overhead_drafting)
    rate(0) = B / (cost_verify(B, 1) + overhead_plain)

with α the conditional per-position acceptance the planner estimates (runtime/planner.py: the session's), and
costs measured on this machine, the scheduler's own per-step overhead included. It drafts only when
``rate(k) > (1 + MARGIN) · rate(0)``: the cost model never predicts a loss for the length it picks,
and a predicted gain within measurement noise is not taken either.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.stats import count_prefix, cycle_positions

MARGIN = 0.05
"""Predicted gain below this fraction of plain decoding's rate is noise: draft nothing."""


class SpeculationConfig(BaseModel):
    """Speculation policy of a session (names follow TensorRT-LLM's ``DecodingBaseConfig``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Literal["static", "auto"] = Field(default="static", description="`static`: each request drafts "
                                            "block_len-1 unless a rule below says 0; `auto`: cost-model choice.")
    max_concurrency: PositiveInt | None = Field(default=None, description="Draft nothing while more requests "
                                                "than this are active.")
    draft_len_schedule: dict[PositiveInt, NonNegativeInt] | None = Field(
        default=None, description="Batch size -> draft length: the value of the smallest key >= the batch size; "
                                  "0 above the largest key. E.g. {1: 15, 4: 7, 16: 3}.")
    acceptance_rate_threshold: float | None = Field(default=None, ge=0.0, le=1.0, description="Stop drafting for "
                                                    "a request whose rolling draft acceptance rate falls below this.")
    acceptance_window: PositiveInt = Field(default=16, description="Cycles in the rolling acceptance window.")


class AcceptanceTracker:
    """Rolling per-position acceptance of one request (or the whole session, as a prior).

    Counts are kept incrementally (a cycle entering the window adds, the one leaving subtracts), so a
    query costs O(positions), not O(window x positions). With a ``horizon``, cycles also leave once that many
    request-steps were ``served`` since them (the most recent ``keep`` stay): a window of cycles alone stops moving
    while nothing drafts.
    """

    def __init__(self, window: int, positions: int, horizon: int | None = None, keep: int = 0) -> None:
        self.cycles: deque[tuple[int, int]] = deque()
        self.window, self.positions = window, positions
        self.horizon, self.keep = horizon, keep
        self.steps_served = 0  # request-steps served so far, drafting or not (``served``)
        self._served_at: deque[int] = deque()  # ``steps_served`` when each cycle in the window was observed
        self.reached = [0] * positions  # cycles that drafted position j with every earlier one accepted
        self.passed = [0] * positions  # ... and accepted it (both as stats.cycle_positions counts them)
        self.drafted = self.accepted = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self._count(drafted, accepted, +1)
        self.cycles.append((drafted, accepted))
        self._served_at.append(self.steps_served)
        while len(self.cycles) > self.window:
            self._forget_oldest()
        self._forget_old()

    def served(self, steps: int) -> None:
        """``steps`` request-steps were served (a step of a batch of B serves B, drafting or not): cycles ``horizon``
        request-steps old are forgotten."""
        self.steps_served += steps
        self._forget_old()

    @property
    def oldest_age(self) -> int | None:
        """Request-steps served since the oldest cycle in the window was observed; None while it holds none."""
        return self.steps_served - self._served_at[0] if self._served_at else None

    def _forget_old(self) -> None:
        if self.horizon is None:
            return
        while len(self.cycles) > self.keep and self._served_at[0] <= self.steps_served - self.horizon:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        self._served_at.popleft()
        self._count(*self.cycles.popleft(), -1)

    def _count(self, drafted: int, accepted: int, sign: int) -> None:
        self.drafted += sign * drafted
        self.accepted += sign * accepted
        counted = cycle_positions(drafted, accepted, self.positions)
        count_prefix(self.reached, counted.reached, sign)
        count_prefix(self.passed, counted.accepted, sign)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def conditional(self, prior: list[float] | None = None, weight: float = 2.0,
                    extra: list[float] | None = None) -> list[float]:
        """α_j = P(position j accepted | positions < j accepted), smoothed toward ``prior`` with ``weight``
        pseudo-cycles. Without a prior, position j is smoothed toward the estimate of position j-1 (0.5 for
        the first): acceptance changes smoothly with depth, so positions never drafted yet are not assumed
        worse than the deepest one measured. ``extra``: accepted counts added per position (an optimistic
        reading of the same cycles), each α then at most 1."""
        alphas: list[float] = []
        for j in range(self.positions):
            toward = prior[j] if prior is not None else (alphas[-1] if alphas else 0.5)
            passed = self.passed[j] + (extra[j] if extra is not None else 0.0)
            alphas.append(min((passed + weight * toward) / (self.reached[j] + weight), 1.0))
        return alphas


def expected_tokens(alphas: list[float], draft_len: int) -> float:
    """``E(k) = 1 + Σ_{i<=k} Π_{j<=i} α_j``: committed tokens per cycle with k drafts (bonus included)."""
    return _expected_table(alphas, draft_len)[-1]


def scheduled_length(schedule: dict[int, int], batch: int) -> int:
    """TensorRT-LLM-style step function: the smallest key >= batch gives the length; none -> 0."""
    keys = sorted(k for k in schedule if k >= batch)
    return schedule[keys[0]] if keys else 0


def static_lengths(config: SpeculationConfig, wanted: list[int], rates: list[float | None]) -> list[int]:
    """Per request: its ``block_len - 1`` unless concurrency, the schedule or its acceptance says 0/less."""
    batch = len(wanted)
    if config.max_concurrency is not None and batch > config.max_concurrency:
        return [0] * batch
    cap = scheduled_length(config.draft_len_schedule, batch) if config.draft_len_schedule else None
    lengths = []
    for want, rate in zip(wanted, rates):
        length = want if cap is None else min(want, cap)
        threshold = config.acceptance_rate_threshold
        if threshold is not None and rate is not None and rate < threshold:
            length = 0
        lengths.append(length)
    return lengths


def auto_length(costs: CostModel, alphas: list[list[float]], wanted: list[int]) -> tuple[int, dict[int, float]]:
    """The draft length (shared by the batch) with the highest predicted tokens/s, and each candidate's rate.

    ``wanted[i] == 0`` marks a request that does not draft (it still commits one token per step). Rates are
    steady-state: taking in a request's pending context is a one-off, priced by the planner where it matters.
    Returns 0 unless some k > 0 is predicted faster than plain decoding by more than ``MARGIN``.
    """
    batch = len(wanted)
    rates = {0: batch / costs.step(batch, 0, 0)}
    longest = max(wanted, default=0)
    drafting = sum(1 for w in wanted if w >= 1)
    shared: dict[tuple[int, int], list[float]] = {}  # E(0..w) per estimate and length, computed once (a batch's rows
    # mostly share one estimate: the session prior)
    tables = []
    for a, w in zip(alphas, wanted):
        if (id(a), w) not in shared:
            shared[id(a), w] = _expected_table(a, w)
        tables.append(shared[id(a), w])
    for k in sorted({min(k, longest) for k in costs.draft_len_candidates(longest)} - {0}):
        tokens = sum(table[min(k, len(table) - 1)] for table in tables)
        rates[k] = tokens / costs.step(batch, drafting, k)
    best = max(rates, key=rates.get)
    return (best, rates) if rates[best] > (1 + MARGIN) * rates[0] else (0, rates)


def _expected_table(alphas: list[float], longest: int) -> list[float]:
    """``[E(0), E(1), .., E(longest)]`` (``expected_tokens``) in one pass; shorter if ``alphas`` is."""
    table, total, survive = [1.0], 1.0, 1.0
    for alpha in alphas[:longest]:
        survive *= alpha
        total += survive
        table.append(total)
    return table
