"""Where each row of a batched forward lives: cache slot, positions, padding (docs/algorithm.md §3.5, batched).

Requests at different positions and block lengths share one forward. Rows are padded to a common
width; a padding token gets the cache's *pad position* (one scratch row past ``max_len``), so its
K/V land where no real query ever looks, and every real query's mask excludes it. Context rows of
the drafter are right-aligned (padding first) so they end right before each row's anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class TargetLayout:
    """Rows ``b`` hold ``lengths[b]`` real tokens at positions ``starts[b] ..`` in cache slot ``slots[b]``."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def width(self) -> int:
        return max(self.lengths)

    @property
    def key_len(self) -> int:
        """Keys read by every row: ``[0, max(start + length))``."""
        return max(s + n for s, n in zip(self.starts, self.lengths))

    def positions(self, pad: int) -> Tensor:
        """``[B, T]`` absolute positions; padding -> ``pad`` (host tensor)."""
        return torch.from_numpy(self.position_array(pad))

    def position_array(self, pad: int) -> np.ndarray:
        """:meth:`positions` as a host numpy array (the graph backends pack their inputs with numpy)."""
        return _right_padded(np.array(self.starts), np.array(self.lengths), self.width, pad)


@dataclass(frozen=True)
class DraftLayout:
    """Rows ``b``: ``context_lens[b]`` new context rows at ``starts[b]-c .. starts[b]-1`` then a block of
    ``block_lens[b]`` rows at ``starts[b] ..``, in draft-cache slot ``slots[b]``."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_lens: tuple[int, ...]

    @property
    def context_width(self) -> int:
        return max(self.context_lens)

    @property
    def block_width(self) -> int:
        return max(self.block_lens)

    @property
    def key_len(self) -> int:
        return max(s + n for s, n in zip(self.starts, self.block_lens))

    def key_limits(self) -> Tensor:
        """``[B]``: row ``b`` may read keys ``< starts[b] + block_lens[b]`` (its context and its own block)."""
        return torch.tensor([s + n for s, n in zip(self.starts, self.block_lens)])

    def positions(self, pad: int) -> Tensor:
        """``[B, C + Bq]`` positions of the K/V rows ``[context ; block]``; padding -> ``pad`` (host tensor)."""
        return torch.from_numpy(self.position_array(pad))

    def position_array(self, pad: int) -> np.ndarray:
        """:meth:`positions` as a host numpy array: the context right-aligned (it ends right before each anchor), the
        block right-padded."""
        starts, contexts = np.array(self.starts), np.array(self.context_lens)
        width = self.context_width
        context = _right_padded(starts - width, np.full_like(contexts, width), width, pad)
        context[np.arange(width)[None, :] < (width - contexts)[:, None]] = pad  # left padding of shorter contexts
        return np.concatenate([context, _right_padded(starts, np.array(self.block_lens), self.block_width, pad)], 1)


def _right_padded(starts: np.ndarray, lengths: np.ndarray, width: int, pad: int) -> np.ndarray:
    """``[B, width]`` int64: row ``b`` holds ``starts[b] ..`` for ``lengths[b]`` columns, then ``pad``."""
    offsets = np.arange(width, dtype=np.int64)
    positions = starts.astype(np.int64)[:, None] + offsets[None, :]
    if lengths.min(initial=width) < width:
        positions[offsets[None, :] >= lengths[:, None]] = pad
    return positions
