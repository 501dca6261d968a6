"""Synthetic cost tables for the speculation-policy tests: a forward costs a base plus a per-token term."""

from __future__ import annotations

from dflash_trt.runtime.costs import CostModel


def linear_costs(verify_base: float, verify_per_token: float, draft_base: float, draft_per_token: float) -> CostModel:
    """Verify and draft forwards at batch 1..64 and width 1..16: ``base + per_token * batch * width`` seconds.

    A large per-token term is a compute-bound machine (a CPU: batch 64 x 16 tokens costs 16x batch 64 x 1);
    a small one is a memory-bound GPU at low batch (16 tokens cost about what one does). Every overhead is kept
    from the first step (no warming steps)."""
    costs = CostModel(warming_steps=0)
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for width in (1, 2, 4, 8, 16):
            costs.record("verify", batch, width, verify_base + verify_per_token * batch * width)
            costs.record("draft", batch, width, draft_base + draft_per_token * batch * width)
    return costs
