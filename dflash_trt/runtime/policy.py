"""Which draft length each request uses this step (0 = plain decoding): static rules or a cost model.

Static mode follows TensorRT-LLM's knobs: ``max_concurrency`` (no drafting above that many active
requests), ``draft_len_schedule`` (batch size -> draft length, a step function) and
``acceptance_rate_threshold`` over a rolling window. ``auto`` maximises expected tokens per second:

    E_r(k) = 1 + Σ_{i=1..k} Π_{j<=i} α_{r,j}        (expected committed tokens of request r, dflash.md §6)
    rate(k) = Σ_r E_r(k) / (cost_draft(B_k, k+1) + cost_verify(B, k+1))

with α the request's rolling conditional per-position acceptance (prior: the session's), and costs
measured on this machine. It drafts only when ``rate(k) > rate(0)``: the cost model never predicts
a loss for the length it picks, so speculation cannot be chosen where it would be slower.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from dflash_trt.runtime.costs import CostModel


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
    """Rolling per-position acceptance of one request (or the whole session, as a prior)."""

    def __init__(self, window: int, positions: int) -> None:
        self.cycles: deque[tuple[int, int]] = deque(maxlen=window)  # (drafted, accepted)
        self.positions = positions

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.cycles.append((drafted, accepted))

    @property
    def acceptance_rate(self) -> float | None:
        drafted = sum(d for d, _ in self.cycles)
        return sum(a for _, a in self.cycles) / drafted if drafted else None

    def conditional(self, prior: list[float] | None = None, weight: float = 2.0) -> list[float]:
        """α_j = P(position j accepted | positions < j accepted), smoothed toward ``prior``."""
        reached = [0] * self.positions
        passed = [0] * self.positions
        for drafted, accepted in self.cycles:
            for j in range(min(drafted, accepted + 1)):
                reached[j] += 1
                passed[j] += j < accepted
        prior = prior or [0.5] * self.positions
        return [(passed[j] + weight * prior[j]) / (reached[j] + weight) for j in range(self.positions)]


def expected_tokens(alphas: list[float], draft_len: int) -> float:
    """``E(k) = 1 + Σ_{i<=k} Π_{j<=i} α_j``: committed tokens per cycle with k drafts (bonus included)."""
    total, survive = 1.0, 1.0
    for alpha in alphas[:draft_len]:
        survive *= alpha
        total += survive
    return total


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

    Returns 0 unless some k > 0 is predicted strictly faster than plain decoding.
    """
    batch = len(wanted)
    best, rates = 0, {0: batch / costs.verify(batch, 1)}
    for k in sorted({min(k, max(wanted)) for k in costs.draft_len_candidates(max(wanted))} - {0}):
        drafting = sum(1 for w in wanted if w >= 1)
        tokens = sum(expected_tokens(a, min(k, w)) for a, w in zip(alphas, wanted))
        rates[k] = tokens / (costs.draft(drafting, k + 1) + costs.verify(batch, k + 1))
        if rates[k] > rates[best]:
            best = k
    return best, rates
