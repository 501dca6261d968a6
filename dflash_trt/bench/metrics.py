"""Aggregate per-request timings into the report's metrics (docs/algorithm.md §6 names)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from dflash_trt.bench.runners import Timing
from dflash_trt.runtime.stats import SpecStats

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = statistics.fmean(values) if values else 0.0
    return out


def summarize(timings: Sequence[Timing], wall_s: float, cost_per_hour: float | None) -> dict[str, Any]:
    """Latency distributions, throughput and acceptance for one mode on one request set.

    ``wall_s`` is the summed wall time of the passes this mode ran (decode + prefill), so
    ``output_tokens_per_s`` is the total throughput at the benchmark's concurrency.
    """
    tokens = sum(len(t.token_ids) for t in timings)
    tpots = [t.tpot_s for t in timings if len(t.token_ids) > 1]
    merged = SpecStats()
    for t in timings:
        if t.stats is not None:
            merged = merged.merge(t.stats)
    median_tpot = statistics.median(tpots) if tpots else 0.0
    out: dict[str, Any] = {
        "requests": len(timings),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "ttft_s": distribution([t.ttft_s for t in timings]),
        "tpot_s": distribution(tpots),
        "itl_s": distribution([gap for t in timings for gap in t.itl_s]),
        "e2e_s": distribution([t.e2e_s for t in timings]),
        "tokens_per_s_per_user": 1.0 / median_tpot if median_tpot > 0 else 0.0,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
    }
    if cost_per_hour is not None and tokens:
        out["cost_per_1k_tokens_usd"] = cost_per_hour * wall_s / 3600 / tokens * 1000
    if any(t.stats is not None for t in timings):
        out["acceptance"] = {
            "mean_acceptance_length": merged.mean_acceptance_length,
            "draft_acceptance_rate": merged.draft_acceptance_rate,
            "per_position_acceptance": merged.per_position_acceptance,
            "acceptance_histogram": merged.acceptance_histogram,
            "num_drafts": merged.num_drafts,
            "num_draft_tokens": merged.num_draft_tokens,
            "num_accepted_tokens": merged.num_accepted_tokens,
            "draft_lens_used": {str(k): v for k, v in sorted(merged.draft_lens_used.items())},
        }
    return out
