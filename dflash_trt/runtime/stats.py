"""``SpecStats``: speculative-decoding counters and the metrics derived from them (docs/algorithm.md §6).

Data only (docs/style.md R11): the loop reports each cycle with :meth:`SpecStats.observe`; sinks (CLI
JSON, benchmark reports, Triton outputs, Prometheus) read the properties. τ includes the bonus token.
:func:`cycle_positions` is the one rule for which draft positions a cycle counts at; ``SpecStats`` and the
policy's rolling ``AcceptanceTracker`` (runtime/policy.py) both count with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    """Counters of one or more generations (``merge`` adds them up)."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    draft_lens_used: dict[int, int] = field(default_factory=dict)
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    def observe(self, drafted: int, accepted: int, produced: int) -> None:
        """Record one cycle: ``drafted`` proposals, ``accepted`` of them, ``produced`` tokens committed.

        ``produced`` is ``accepted + 1`` unless capped by ``max_new_tokens`` or cut at a stop token;
        it is the per-cycle acceptance length as the reference counts it.
        """
        self.acceptance_lengths.append(produced)
        self.draft_lens_used[drafted] = self.draft_lens_used.get(drafted, 0) + 1
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        counted = cycle_positions(drafted, accepted)
        _grow(self.accepted_per_position, drafted)  # both lists span every drafted position (rates zip them)
        _grow(self.drafted_per_position, drafted)
        _grow(self.histogram, drafted + 1)
        count_prefix(self.drafted_per_position, counted.drafted)
        count_prefix(self.accepted_per_position, counted.accepted)
        self.histogram[accepted] += 1

    def merge(self, other: SpecStats) -> SpecStats:
        """Sum of two stats (e.g. over the requests of a benchmark); timings add up."""
        merged = SpecStats()
        for name in ("num_prompt_tokens", "num_output_tokens", "num_drafts", "num_draft_tokens",
                     "num_accepted_tokens", "ttft_s", "e2e_s"):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        merged.acceptance_lengths = self.acceptance_lengths + other.acceptance_lengths
        for name in ("accepted_per_position", "drafted_per_position", "histogram"):
            a, b = getattr(self, name), getattr(other, name)
            size = max(len(a), len(b))
            setattr(merged, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size)])
        merged.draft_lens_used = dict(self.draft_lens_used)
        for length, count in other.draft_lens_used.items():
            merged.draft_lens_used[length] = merged.draft_lens_used.get(length, 0) + count
        return merged

    @property
    def mean_acceptance_length(self) -> float:
        """τ = mean of the per-cycle acceptance lengths (accepted + 1, the bonus included; 1 for plain decoding)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """``num_accepted_tokens / num_draft_tokens`` (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """``[i]`` = cycles that accepted >= i+1 drafts / cycles that drafted position i (per-position denominator)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def acceptance_histogram(self) -> list[int]:
        """``[j]`` = cycles that accepted exactly j drafts, j = 0..K."""
        return list(self.histogram)

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: ``(e2e - TTFT) / (output_tokens - 1)``."""
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tokens / end-to-end wall time (prefill included)."""
        return self.num_output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode-only speed ``1 / TPOT`` (the z-lab speed-up compares this between DFlash and plain decoding)."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every counter and metric under the names of docs/algorithm.md §6 (JSON-ready)."""
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "acceptance_histogram": self.acceptance_histogram,
            "draft_lens_used": {str(k): v for k, v in sorted(self.draft_lens_used.items())},
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass(frozen=True)
class CyclePositions:
    """The draft positions one cycle counts at, each set a prefix ``0 … n-1`` held as its length ``n``.

    A cycle that drafted ``d`` tokens and accepted the first ``a`` (``0 <= a <= d``), with at most ``P``
    positions kept, counts at position ``j`` (0-based) when:

        drafted[j]  = j < min(d, P)             proposed (per-position denominator, docs/algorithm.md §6)
        reached[j]  = j < min(d, a + 1, P)      proposed with every earlier draft accepted (the denominator of
                                                the conditional α_j, docs/algorithm.md §3.6)
        accepted[j] = j < min(a, P)             accepted (the numerator of both)
    """

    drafted: int
    reached: int
    accepted: int


def cycle_positions(drafted: int, accepted: int, positions: int | None = None) -> CyclePositions:
    """:class:`CyclePositions` of one cycle: ``drafted`` proposals of which the first ``accepted`` were taken,
    counted over the first ``positions`` draft positions (all of them when None)."""
    assert 0 <= accepted <= drafted, f"accepted {accepted} of {drafted} drafts"
    cap = drafted if positions is None else min(drafted, positions)
    return CyclePositions(drafted=cap, reached=min(accepted + 1, cap), accepted=min(accepted, cap))


def count_prefix(counts: list[int], length: int, sign: int = 1) -> None:
    """``counts[j] += sign`` for ``j < length`` (a cycle entering a window adds 1, one leaving subtracts 1)."""
    for j in range(length):
        counts[j] += sign


def _grow(values: list[int], size: int) -> None:
    values.extend([0] * (size - len(values)))
