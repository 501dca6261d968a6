"""Measure the shape of the forward costs before serving (``auto`` speculation prices its first steps with it).

Times a few target and draft forwards on scratch positions, then resets every cache slot: verify at 1 token and
at the full block, and draft at the full block, at batch 1 and at the largest batch (then at a middle width and
batch where time allows), cheapest first, and stops starting new points once ``BUDGET_S`` seconds have passed.
Every row first holds ``CONTEXT`` scratch positions, so a forward attends over a context like a served
request's. The cost model reads these points as the *shape* of the costs and anchors them on what plain steps
cost in traffic, which it measures from the first step on (``runtime/costs.py``): a few points suffice, and a
point left out is interpolated. A full batch x width grid took minutes on a CPU for a bf16 Qwen3-0.6B-shaped
target (docs/serving-notes.md §13).

Before timing, a one-row draft call runs once for each context a cycle can hand the drafter (1 to ``block_len``
taps: the anchor plus the accepted drafts), untimed. A backend's first call of a shape costs more than the next
ones (an ONNX Runtime engine's one-row draft: 1.1 ms the first time at each context, 0.6 ms after), and a session's
first cycles meet a new context almost every cycle: priced from them, drafting at batch 1 looked 1.5-2x dearer
than it is, and ``auto`` decoded plainly where drafting won 1.3x.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from dflash_trt.plugins.interface import Backend, DraftRow, TargetRow
from dflash_trt.runtime.costs import CostModel

_REPEATS = 3
"""Timed calls per point (after a warm-up), fewer once the budget is spent."""

BUDGET_S = 10.0
"""Seconds after which calibration starts no new point (a point under way finishes)."""

ALWAYS = 3
"""Points timed whatever the budget: verify of 1 token and of the block, and draft of the block, at batch 1."""

CONTEXT = 64
"""Scratch positions every calibration row attends over (fewer where the cache is shorter)."""

TAPS = 4
"""Context taps each timed draft row takes in: about what a cycle accepts, so a steady-state draft call."""


def _points(max_batch: int, block_len: int, has_drafter: bool) -> list[tuple[str, int, int]]:
    """``(kind, batch, width)`` in the order they are timed: the corners of the batch x width range first (the
    cheapest first), then a middle width and a middle batch."""
    mid_width = min(4, block_len)
    mid_batch = max(1, int(round(max_batch ** 0.5)))
    points = []
    for batch in dict.fromkeys((1, max_batch)):
        points += [("verify", batch, 1), ("verify", batch, block_len)]
        points += [("draft", batch, block_len)] if has_drafter and block_len > 1 else []
        if batch == 1:
            points += [("verify", 1, mid_width)] + ([("draft", 1, mid_width)] if has_drafter and mid_width > 1 else [])
    for batch in dict.fromkeys((max_batch, mid_batch)):
        points += [("verify", batch, mid_width)] + ([("draft", batch, mid_width)] if has_drafter and mid_width > 1
                                                   else [])
    for batch in dict.fromkeys((mid_batch,)):
        points += [("verify", batch, 1), ("verify", batch, block_len)]
        points += [("draft", batch, block_len)] if has_drafter and block_len > 1 else []
    return list(dict.fromkeys(points))


def _timed(run, restore, clock: Callable[[], float], deadline: float) -> float:
    """Median of up to ``_REPEATS`` timed calls after a warm-up (one once ``deadline`` has passed), ``restore()``
    between calls (untimed). The median, like the online estimate."""
    run()  # warm-up
    restore()
    times = []
    while len(times) < _REPEATS and (not times or clock() < deadline):
        began = clock()
        run()
        times.append(clock() - began)
        restore()
    return statistics.median(times)


def calibrate(backend: Backend, costs: CostModel, has_drafter: bool, block_len: int, max_seq_len: int,
              clock: Callable[[], float] = time.perf_counter, budget_s: float = BUDGET_S,
              warm_shapes: bool = True) -> CostModel:
    """Fill ``costs`` with the median time of a few verify and draft forwards (``_points``) at a context of
    ``CONTEXT`` scratch positions (bounded so the widest block still fits ``max_seq_len``), starting no new point
    after ``budget_s`` seconds (the first ``ALWAYS`` are always timed). ``warm_shapes``: first run the one-row
    draft call at every context a cycle can bring (a backend whose first call of a shape costs nothing extra, such
    as the policy simulator's, may skip it)."""
    deadline = clock() + budget_s
    config = backend.draft_config
    taps_width = len(config.target_layer_ids) * config.hidden_size if has_drafter else 0
    block_len = max(block_len, 1)
    context = max(min(CONTEXT, max_seq_len - block_len - 1), 0)
    taps = min(TAPS, context)
    device = getattr(backend, "device", torch.device("cpu"))
    dtype = getattr(backend, "dtype", torch.float32)  # taps come in the runtime dtype, as the target returns them
    slots: list[int] = []  # slots holding the scratch context
    # a DFlash2 drafter drafts through propose_batch (an engine's DFlash2 graph returns proposals, not logits)
    draft_call = backend.propose_batch if getattr(config, "architecture", None) == "dflash2" else backend.draft_batch

    def fill(batch: int) -> None:
        """Give slots ``len(slots)..batch-1`` the scratch context (a whole batch's only when its points are timed)."""
        new = list(range(len(slots), batch))
        if context and new:
            backend.target_batch([TargetRow(slot, [0] * context, 0, last_only=True) for slot in new], has_drafter)
            if has_drafter:  # the draft caches take in the same scratch context
                draft_call([DraftRow(slot, [0, 0], torch.zeros(context, taps_width, dtype=dtype, device=device),
                                     context) for slot in new])
        slots.extend(new)

    def restore() -> None:
        for slot in slots:
            backend.crop_target_slot(slot, context)

    if warm_shapes and has_drafter and block_len > 1 and context:
        fill(1)
        for taken in range(1, min(block_len, context) + 1):  # untimed, cheapest first; ends with the budget
            if clock() >= deadline:
                break
            draft_call([DraftRow(0, [0] * block_len, torch.zeros(taken, taps_width, dtype=dtype, device=device),
                                 context)])
    for index, (kind, batch, width) in enumerate(_points(backend.max_batch, block_len, has_drafter)):
        if index >= ALWAYS and clock() >= deadline:
            break
        fill(batch)
        if kind == "verify":
            run = partial(backend.target_batch, [TargetRow(slot, [0] * width, context) for slot in range(batch)],
                          has_drafter)
        else:  # a DFlash2 drafter's draft call includes its selector walk (what the step calls)
            run = partial(draft_call, [DraftRow(slot, [0] * width, torch.zeros(taps, taps_width, dtype=dtype,
                                                                           device=device), context)
                                  for slot in range(batch)])
        costs.calibrate(kind, batch, width, _timed(run, restore, clock, deadline))
    for slot in slots:
        backend.reset_slot(slot)
    return costs
