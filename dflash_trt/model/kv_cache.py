"""Static, preallocated KV cache with exact crop/rewind (docs/algorithm.md §3.5, docs/style.md R5).

Row ``i`` of the cache holds the key/value of absolute position ``i``, so cropping to the
accepted prefix is bookkeeping only: the next write at ``start`` overwrites the rejected rows,
and attention reads keys ``[0, start + T)``. Buffers are allocated once; their addresses never
change, which keeps the hot path free of allocation and capturable by CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.model.layouts import DraftLayout, TargetLayout


class StaticKVCache:
    """Per-layer K/V buffers ``[layers, batch, nkv, max_len + 1, d]`` plus committed lengths per slot.

    Position ``max_len`` (``pad_position``) is scratch: padding rows of a batched forward write there.
    """

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
        shape = (num_layers, max_batch, num_kv_heads, max_len + 1, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.pad_position = max_len
        self.lengths = [0] * max_batch

    def write(self, layer: int, start: int | TargetLayout | DraftLayout, keys: Tensor, values: Tensor,
              positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Store new rows and return the keys/values every row of this forward may read.

        ``start`` int: rows ``0..B-1`` write positions ``start .. start+T-1`` (the batch-1 fast path) and
        get ``[B, nkv, start+T, d]``. A layout: row ``b`` writes ``positions[b]`` of slot ``slots[b]`` and
        gets ``[B, nkv, key_len, d]`` (the caller masks what a row may not see).
        Shapes: keys/values ``[B, nkv, T, d]``. Lengths advance once per forward (:meth:`commit`).
        """
        if not isinstance(start, int):
            slots = torch.tensor(start.slots, device=self.keys.device)
            # advanced indices [B,1] and [B,T] around a slice: the indexed view is [B, T, nkv, d]
            self.keys[layer][slots.unsqueeze(1), :, positions] = keys.transpose(1, 2)
            self.values[layer][slots.unsqueeze(1), :, positions] = values.transpose(1, 2)
            if list(start.slots) == list(range(len(start.slots))):
                batch = len(start.slots)
                return self.keys[layer, :batch, :, :start.key_len], self.values[layer, :batch, :, :start.key_len]
            # cut to key_len before gathering: copy what the rows read, not the whole max_len buffer
            return (self.keys[layer, :, :, :start.key_len].index_select(0, slots),
                    self.values[layer, :, :, :start.key_len].index_select(0, slots))
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

    def check_rows(self, slots: tuple[int, ...], starts: tuple[int, ...], ends: tuple[int, ...]) -> None:
        """Internal invariant of a batched write: each slot's write starts within its committed rows."""
        for slot, begin, end in zip(slots, starts, ends):
            assert begin <= self.lengths[slot], f"cache gap: slot {slot} write at {begin}, committed {self.lengths[slot]}"
            assert end <= self.max_len, f"cache overflow: slot {slot} {end} > {self.max_len}"

    def commit_rows(self, slots: tuple[int, ...], ends: tuple[int, ...]) -> None:
        for slot, end in zip(slots, ends):
            self.lengths[slot] = end

    def crop_slot(self, slot: int, length: int) -> None:
        """Discard rows ``>= length`` of one slot."""
        self.lengths[slot] = min(self.lengths[slot], length)

    def reset_slot(self, slot: int) -> None:
        self.lengths[slot] = 0

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
