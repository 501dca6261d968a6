"""Measure forward costs before serving (``auto`` speculation needs them from the first step).

Runs target and draft forwards over a grid of batch sizes and widths on scratch positions, then
resets every cache slot. Takes well under a second on small models; the scheduler keeps refining
the same table from real traffic.
"""

from __future__ import annotations

import time

import torch

from dflash_trt.plugins.interface import Backend, DraftRow, TargetRow
from dflash_trt.runtime.costs import CostModel

_REPEATS = 5


def _grid(limit: int) -> list[int]:
    values, value = [], 1
    while value < limit:
        values.append(value)
        value *= 2
    return values + [limit]


def _timed(run) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(_REPEATS):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def calibrate(backend: Backend, costs: CostModel, has_drafter: bool, block_len: int) -> CostModel:
    """Fill ``costs`` with the best-of-5 time of verify and draft forwards (batch x width grid).

    Rows start at position 0 of every slot (scratch content; all slots are reset afterwards).
    """
    config = backend.draft_config
    taps_width = len(config.target_layer_ids) * config.hidden_size if has_drafter else 0
    context = 4
    device = getattr(backend, "device", torch.device("cpu"))
    for batch in _grid(backend.max_batch):
        for width in _grid(max(block_len, 1)):
            rows = [TargetRow(slot, [0] * width, 0) for slot in range(batch)]
            costs.record("verify", batch, width, _timed(lambda: backend.target_batch(rows, has_drafter)), anchor=True)
            if has_drafter and width > 1:
                drafts = [DraftRow(slot, [0] * width, torch.zeros(context, taps_width, device=device), context)
                          for slot in range(batch)]
                costs.record("draft", batch, width, _timed(lambda: backend.draft_batch(drafts)), anchor=True)
    for slot in range(backend.max_batch):
        backend.reset_slot(slot)
    return costs
