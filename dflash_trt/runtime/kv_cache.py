"""Static, preallocated KV cache with exact crop/rewind (dflash.md §3.5, style R5).

Row ``i`` of the cache holds the key/value of absolute position ``i``, so cropping to the
accepted prefix is bookkeeping only: the next write at ``start`` overwrites the rejected rows,
and attention reads keys ``[0, start + T)``. Buffers are allocated once; their addresses never
change, which keeps the hot path free of allocation and capturable by CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StaticKVCache:
    """Per-layer K/V buffers ``[layers, batch, nkv, max_len, d]`` plus committed lengths per batch row."""

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, max_batch, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * max_batch

    def write(self, layer: int, start: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store new rows at positions ``start .. start+T-1`` for batch row 0..B-1 and return the live prefix.

        Shapes: keys/values ``[B, nkv, T, d]`` -> cached keys/values ``[B, nkv, start+T, d]``.
        The caller advances ``lengths`` once per forward with :meth:`commit`, not per layer.
        """
        batch, tokens = keys.shape[0], keys.shape[2]
        end = start + tokens
        self.keys[layer, :batch, :, start:end] = keys
        self.values[layer, :batch, :, start:end] = values
        return self.keys[layer, :batch, :, :end], self.values[layer, :batch, :, :end]

    def check_write(self, start: int, tokens: int, batch: int = 1) -> None:
        """Internal invariant: writes are contiguous with what is committed and fit the buffer."""
        for row in range(batch):
            assert start <= self.lengths[row], f"cache gap: write at {start}, committed {self.lengths[row]}"
        assert start + tokens <= self.max_len, f"cache overflow: {start}+{tokens} > {self.max_len}"

    def commit(self, end: int, batch: int = 1) -> None:
        """Mark rows ``< end`` as written for batch rows ``0..batch-1``."""
        for row in range(batch):
            self.lengths[row] = end

    def crop(self, length: int, batch: int = 1) -> None:
        """Discard rows ``>= length`` (rejected drafts, block rows): they are overwritten by the next write."""
        for row in range(batch):
            self.lengths[row] = min(self.lengths[row], length)

    def reset(self) -> None:
        """Forget everything (a new request); buffers are reused, not freed."""
        self.lengths = [0] * len(self.lengths)
