"""Measure forward costs before serving (``auto`` speculation needs them from the first step).

Runs target and draft forwards over a grid of batch sizes and widths on scratch positions, then
resets every cache slot. Every row first holds ``CONTEXT`` scratch positions, so a forward attends over
a context like a served request's, not an empty cache (a step's cost grows with its context, and plain
steps are measured online at the served contexts from the first step on). Takes about a second on small
models; the scheduler keeps refining the same table from real traffic, and treats the grid as the shape
of the costs whose scale traffic measures (``runtime/costs.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from dflash_trt.plugins.interface import Backend, DraftRow, TargetRow
from dflash_trt.runtime.costs import CostModel

_REPEATS = 5

CONTEXT = 64
"""Scratch positions every calibration row attends over (fewer where the cache is shorter)."""

TAPS = 4
"""Context taps each timed draft row takes in: about what a cycle accepts, so a steady-state draft call."""


def _grid(limit: int) -> list[int]:
    values, value = [], 1
    while value < limit:
        values.append(value)
        value *= 2
    return values + [limit]


def _timed(run, restore, clock: Callable[[], float]) -> float:
    """Median of ``_REPEATS`` timed calls after a warm-up, ``restore()`` between calls (untimed). The median,
    like the online estimate: a best-of would be biased low against the online medians it is compared to."""
    run()  # warm-up
    restore()
    times = []
    for _ in range(_REPEATS):
        began = clock()
        run()
        times.append(clock() - began)
        restore()
    return statistics.median(times)


def calibrate(backend: Backend, costs: CostModel, has_drafter: bool, block_len: int, max_seq_len: int,
              clock: Callable[[], float] = time.perf_counter) -> CostModel:
    """Fill ``costs`` with the median time of verify and draft forwards (batch x width grid) at a context of
    ``CONTEXT`` scratch positions (bounded so the widest block still fits ``max_seq_len``)."""
    config = backend.draft_config
    taps_width = len(config.target_layer_ids) * config.hidden_size if has_drafter else 0
    block_len = max(block_len, 1)
    context = max(min(CONTEXT, max_seq_len - block_len - 1), 0)
    taps = min(TAPS, context)
    device = getattr(backend, "device", torch.device("cpu"))
    dtype = getattr(backend, "dtype", torch.float32)  # taps come in the runtime dtype, as the target returns them
    slots = range(backend.max_batch)
    if context:
        backend.target_batch([TargetRow(slot, [0] * context, 0, last_only=True) for slot in slots], has_drafter)
    # a DFlash2 drafter drafts through propose_batch (an engine's DFlash2 graph returns proposals, not logits)
    draft_call = backend.propose_batch if getattr(config, "architecture", None) == "dflash2" else backend.draft_batch
    if has_drafter and context:  # the draft caches take in the same scratch context
        draft_call([DraftRow(slot, [0, 0], torch.zeros(context, taps_width, dtype=dtype, device=device), context)
                    for slot in slots])

    def restore() -> None:
        for slot in slots:
            backend.crop_target_slot(slot, context)

    for batch in _grid(backend.max_batch):
        for width in _grid(block_len):
            rows = [TargetRow(slot, [0] * width, context) for slot in range(batch)]
            costs.calibrate("verify", batch, width, _timed(partial(backend.target_batch, rows, has_drafter), restore, clock))
            if has_drafter and width > 1:
                drafts = [DraftRow(slot, [0] * width, torch.zeros(taps, taps_width, dtype=dtype, device=device), context)
                          for slot in range(batch)]
                costs.calibrate("draft", batch, width, _timed(partial(draft_call, drafts), restore, clock))
    for slot in slots:
        backend.reset_slot(slot)
    return costs
