"""The device index tensors a step's shape determines, built once per shape and reused (docs/design.md §3.7).

A step's shape is its draft count per row and, for the verify tokens, how its rows fall into sampling groups. In
steady state every step of a batch has the same shape, so ``runtime/step.py`` takes these from a cache instead of
copying the same Python ints to the device again each step.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from dflash_trt.model.transfer import to_device
from dflash_trt.runtime.verify import RowLayout

CACHED_SHAPES = 256
"""Step shapes (draft counts per row) whose index tensors are kept for reuse."""


@lru_cache(maxsize=CACHED_SHAPES)
def token_index(counts: tuple[int, ...], groups: tuple[tuple[int, ...], ...], device: torch.device) -> Tensor:
    """Where each verify token comes from in ``[anchors, -1, proposals of each group in turn]``: ``[R, K+1]``. A
    function of the step's shape only, so steady-state steps reuse it instead of copying it over again."""
    rows, offsets = len(counts), {}
    base = rows + 1
    for members in groups:
        for i in members:
            offsets[i] = base
            base += counts[i]
    width = max(counts, default=0) + 1
    index = [i if j == 0 else (offsets[i] + j - 1 if j <= counts[i] else rows)
             for i in range(rows) for j in range(width)]
    return to_device(index, device).view(rows, width)


@lru_cache(maxsize=CACHED_SHAPES)
def row_layout(counts: tuple[int, ...], device: torch.device) -> RowLayout:
    """``RowLayout.of``, reused by steps of the same counts (in steady state, every step of a batch)."""
    return RowLayout.of(counts, device)
