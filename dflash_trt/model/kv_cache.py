"""Static, preallocated KV cache with exact crop/rewind (docs/algorithm.md §3.5, docs/style.md R5).

Row ``i`` of the cache holds the key/value of absolute position ``i``, so cropping to the
accepted prefix is bookkeeping only: the next write at ``start`` overwrites the rejected rows,
and attention reads keys ``[0, start + T)``. Buffers are allocated once; their addresses never
change, which keeps the hot path free of allocation and capturable by CUDA graphs.

``KVCachePlan`` is what a session's caches will take, computed from the configs before anything is
allocated: start-up prints it and refuses a plan that does not fit (``model/memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflash_trt.model.layouts import DraftLayout, TargetLayout
from dflash_trt.model.transfer import to_device


def format_bytes(count: int) -> str:
    """``3.52 GiB``, ``117.4 MiB`` or ``40.5 KiB``: the largest binary unit that keeps the figure >= 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}" if unit == "GiB" else f"{count / size:.1f} {unit}"
    return f"{count} B"


@dataclass(frozen=True)
class CacheLayout:
    """One network's slot caches: ``per_slot_buffers`` buffers of ``[layers, max_batch, kv_heads, max_seq_len +
    extra_rows, head_dim]`` (K and V; a backend that also keeps gather buffers has 4) plus ``shared_buffers`` of one
    slot's size that are not per slot (e.g. a plugin graph's prefix input)."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    per_slot_buffers: int = 2
    shared_buffers: int = 0
    extra_rows: int = 1  # StaticKVCache's scratch row (pad_position)

    @classmethod
    def of(cls, config, dtype: torch.dtype, **buffers: int) -> CacheLayout:
        """From a ``TargetConfig`` or ``DraftConfig`` (``num_layers``, ``num_kv_heads``, ``head_dim``)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, itemsize, **buffers)

    @property
    def bytes_per_position(self) -> int:
        """``layers x kv_heads x head_dim x itemsize``: one slot's K (or V) row at one position."""
        return self.layers * self.kv_heads * self.head_dim * self.itemsize

    def bytes(self, max_batch: int, max_seq_len: int) -> int:
        """``(per_slot_buffers x max_batch + shared_buffers) x (max_seq_len + extra_rows) x bytes_per_position``."""
        return ((self.per_slot_buffers * max_batch + self.shared_buffers) * (max_seq_len + self.extra_rows)
                * self.bytes_per_position)


@dataclass(frozen=True)
class KVCachePlan:
    """The target's and the drafter's caches at ``max_batch`` x ``max_seq_len`` in ``dtype`` on ``device``."""

    target: CacheLayout
    draft: CacheLayout | None
    max_batch: int
    max_seq_len: int
    dtype: str
    device: str = "cpu"

    @property
    def target_bytes(self) -> int:
        return self.target.bytes(self.max_batch, self.max_seq_len)

    @property
    def draft_bytes(self) -> int:
        return self.draft.bytes(self.max_batch, self.max_seq_len) if self.draft is not None else 0

    @property
    def total_bytes(self) -> int:
        return self.target_bytes + self.draft_bytes

    def bytes_at(self, max_batch: int, max_seq_len: int) -> int:
        layouts = [self.target] + ([self.draft] if self.draft is not None else [])
        return sum(layout.bytes(max_batch, max_seq_len) for layout in layouts)

    def largest_seq_len(self, budget: int) -> int:
        """The largest ``max_seq_len`` whose caches fit ``budget`` bytes at this ``max_batch`` (0: none)."""
        low, high = 0, self.max_seq_len
        while low < high:  # bytes grow with the length: bisect for the last one that fits
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.bytes_at(self.max_batch, middle) <= budget else (low, middle - 1)
        return low

    def largest_batch(self, budget: int) -> int:
        """The largest ``max_batch`` whose caches fit ``budget`` bytes at this ``max_seq_len`` (0: none)."""
        return max((b for b in range(self.max_batch, 0, -1) if self.bytes_at(b, self.max_seq_len) <= budget),
                   default=0)

    def line(self) -> str:
        """The start-up line: what is allocated, for which limits."""
        draft = format_bytes(self.draft_bytes) if self.draft is not None else "none"
        return (f"KV cache: target {format_bytes(self.target_bytes)} + drafter {draft} (max_batch {self.max_batch} x "
                f"max_seq_len {self.max_seq_len}, dtype {self.dtype}"
                + (f", on {self.device}" if self.device != "cpu" else "") + ")")


class StaticKVCache:
    """The slot cache of every backend: layer-major K/V buffers ``[layers, max_batch, nkv, max_len + extra_rows, d]``
    plus committed lengths per slot, on any device.

    The torch networks write it themselves (:meth:`write`); the graphs of the ONNX Runtime and TensorRT backends get
    per-layer views ``[B, nkv, S, d]`` of it (:meth:`bound`: a run of consecutive slots is a view, other sets are
    gathered into buffers kept for it), either extending them in place or returning new rows that :meth:`store`
    writes. The ONNX Runtime backend reads the same buffers as numpy arrays (CPU tensors share their memory).
    Position ``max_len`` (``pad_position``) is where padding rows sit: with ``extra_rows=1`` a scratch row that the
    torch networks' padding rows write; graphs treat every position ``>= S`` (their buffers' length) as padding and
    need no scratch row. ``gather`` and ``prefix`` allocate the buffers :meth:`bound` and :meth:`prefix` use
    (``CacheLayout`` counts them: 2 + 2 per-slot buffers, 2 of one slot's size).
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
        extra_rows: int = 1,
        gather: bool = False,
        prefix: bool = False,
    ) -> None:
        shape = (num_layers, max_batch, num_kv_heads, max_len + extra_rows, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        empty = torch.zeros(0, dtype=dtype, device=device)
        self.gather_keys = torch.zeros(shape, dtype=dtype, device=device) if gather else empty
        self.gather_values = torch.zeros(shape, dtype=dtype, device=device) if gather else empty
        one_slot = num_layers * num_kv_heads * (max_len + extra_rows) * head_dim
        self.prefix_keys = torch.zeros(one_slot, dtype=dtype, device=device) if prefix else empty
        self.prefix_values = torch.zeros(one_slot, dtype=dtype, device=device) if prefix else empty
        self.max_len = max_len
        self.pad_position = max_len
        self.lengths = [0] * max_batch
        # the same memory as numpy arrays on the host, for rows a host executor returns as numpy (:meth:`store`)
        self._host = ((self.keys.numpy(), self.values.numpy())
                      if self.keys.device.type == "cpu" and dtype in (torch.float32, torch.float16) else None)

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    def views(self, first: int, count: int) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer, slots ``first .. first+count-1`` as ``[count, nkv, S, d]`` views (contiguous): what an in-place
        graph reads and extends."""
        end = first + count
        return ([self.keys[layer, first:end] for layer in range(self.num_layers)],
                [self.values[layer, first:end] for layer in range(self.num_layers)])

    def bound(self, slots: list[int], live: int) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer, the caches of ``slots`` as ``[B, nkv, S, d]``, of which a graph reads rows ``< live``: views when
        the slots are consecutive, else those rows gathered into the gather buffers (rows past ``live`` stale)."""
        first, batch = slots[0], len(slots)
        if slots == list(range(first, first + batch)):
            return self.views(first, batch)
        index = to_device(slots, self.keys.device)
        for source, target in ((self.keys, self.gather_keys), (self.values, self.gather_values)):
            for layer in range(self.num_layers):
                torch.index_select(source[layer, :, :, :live], 0, index, out=target[layer, :batch, :, :live])
        return ([self.gather_keys[layer, :batch] for layer in range(self.num_layers)],
                [self.gather_values[layer, :batch] for layer in range(self.num_layers)])

    def store(self, slot: int, start: int, keys: Tensor | np.ndarray, values: Tensor | np.ndarray) -> None:
        """Write new rows ``[layers, nkv, n, d]`` (tensors, or numpy arrays on the host) at positions ``start ..`` of
        ``slot``; commit them."""
        end = start + keys.shape[2]
        cache_keys, cache_values = self._host if isinstance(keys, np.ndarray) else (self.keys, self.values)
        cache_keys[:, slot, :, start:end] = keys
        cache_values[:, slot, :, start:end] = values
        self.lengths[slot] = end

    def prefix(self, slot: int, rows: int) -> tuple[Tensor, Tensor]:
        """Rows ``< rows`` of ``slot`` copied contiguously as ``[layers, 1, nkv, rows, d]`` (a plugin graph's input)."""
        source_keys, source_values = self.keys[:, slot, :, :rows], self.values[:, slot, :, :rows]
        keys = self.prefix_keys[:source_keys.numel()].view(source_keys.shape)
        values = self.prefix_values[:source_values.numel()].view(source_values.shape)
        keys.copy_(source_keys)
        values.copy_(source_values)
        return keys.unsqueeze(1), values.unsqueeze(1)

    def write(self, layer: int, start: int | TargetLayout | DraftLayout, keys: Tensor, values: Tensor,
              positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Store new rows and return the keys/values every row of this forward may read.

        ``start`` int: rows ``0..B-1`` write positions ``start .. start+T-1`` (the batch-1 fast path) and
        get ``[B, nkv, start+T, d]``. A layout: row ``b`` writes ``positions[b]`` of slot ``slots[b]`` and
        gets ``[B, nkv, key_len, d]`` (the caller masks what a row may not see).
        Shapes: keys/values ``[B, nkv, T, d]``. Lengths advance once per forward (:meth:`commit`).
        """
        if not isinstance(start, int):
            slots = to_device(start.slots, self.keys.device)
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
            assert begin <= self.lengths[slot], (f"cache gap: slot {slot} write at {begin}, "
                                                 f"committed {self.lengths[slot]}")
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


class SlotCaches:
    """A backend's two slot caches, ``target_cache`` and ``draft_cache`` (None without a drafter), and what the
    backend protocol's ``reset_slot`` and ``crop_target_slot`` do to them (bookkeeping only)."""

    target_cache: StaticKVCache
    draft_cache: StaticKVCache | None

    def reset_slot(self, slot: int) -> None:
        self.target_cache.reset_slot(slot)
        if self.draft_cache is not None:
            self.draft_cache.reset_slot(slot)

    def crop_target_slot(self, slot: int, length: int) -> None:
        self.target_cache.crop_slot(slot, length)
