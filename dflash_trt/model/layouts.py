"""Where each row of a batched forward lives: cache slot, positions, padding (docs/algorithm.md §3.5, batched).

Requests at different positions and block lengths share one forward. Rows are padded to a common
width; a padding token gets the cache's *pad position* (one scratch row past ``max_len``), so its
K/V land where no real query ever looks, and every real query's mask excludes it. Context rows of
the drafter are right-aligned (padding first) so they end right before each row's anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        """``[B, T]`` absolute positions; padding -> ``pad``."""
        offsets = torch.arange(self.width)
        starts = torch.tensor(self.starts).unsqueeze(1)
        real = offsets.unsqueeze(0) < torch.tensor(self.lengths).unsqueeze(1)
        return torch.where(real, starts + offsets, torch.full_like(starts + offsets, pad))


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
        """``[B, C + Bq]`` positions of the K/V rows ``[context ; block]``; padding -> ``pad``."""
        rows = []
        for start, ctx, block in zip(self.starts, self.context_lens, self.block_lens):
            left = [pad] * (self.context_width - ctx) + list(range(start - ctx, start))
            right = list(range(start, start + block)) + [pad] * (self.block_width - block)
            rows.append(left + right)
        return torch.tensor(rows)
