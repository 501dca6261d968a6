"""Rows of several requests as one call of an engine graph, over the one slot cache (docs/design.md §3.2).

The ONNX Runtime and TensorRT backends run the same graphs (``builder/export_onnx.py`` has their I/O) through an
:class:`Executor`: an ONNX Runtime session on the host, or a TensorRT plan on the GPU. Everything around the call
is written once, here: packing rows into padded inputs on the host (``model/layouts.py`` gives each row's
positions; padding sits at position ``S``), binding each row's cache slot (``model/kv_cache.py``: views, or
gathered rows), writing back the K/V rows a graph returns, and the plugin-node drafter that runs one row per call.
The same indexing code runs on numpy arrays for a host executor (``numpy_io``: an ONNX Runtime session, whose
inputs and outputs are numpy; torch's per-call overhead on small CPU tensors is ~20x numpy's, measured 290-360 us
against 12 us for one draft call's 16 K/V write-backs) and on torch tensors for a device one. Nothing here reads a
device tensor back to the host.

* :meth:`GraphRows.target`: ``target.onnx``, every row in one call; it returns each row's new K/V.
* :meth:`GraphRows.draft`: ``draft.onnx``, every drafting row in one call, each with its own context length (rows
  taking in a prompt in a call of their own: ``interface.intake_groups``).
* :meth:`GraphRows.propose`: a DFlash2 drafter's ``draft.onnx``, the same call with the candidate selector walked in
  the graph (each row's temperature and uniforms in, its path, candidates and proposal probabilities out), split alike.
* :meth:`GraphRows.draft_plugin`: ``draft_plugin.onnx`` (``DFlashBlockAttention`` nodes, prefix I/O), one row per
  call, since the op's rows share one context length.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.errors import RequestError
from dflash_trt.model.kv_cache import StaticKVCache
from dflash_trt.model.layouts import DraftLayout, TargetLayout
from dflash_trt.plugins.interface import DraftProposal, DraftRow, TargetRow, by_intake


class Executor(Protocol):
    """Runs one graph: named input tensors -> named output tensors, on the cache's device (numpy arrays for a host
    executor driven with ``numpy_io``).

    ``reuses_outputs``: the outputs are views of buffers the next ``run`` overwrites (the caller copies what it
    keeps)."""

    input_names: frozenset[str]
    reuses_outputs: bool

    def run(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]: ...


def pack_target(rows: list[TargetRow], pad: int) -> tuple[np.ndarray | Tensor, np.ndarray, TargetLayout]:
    """``tokens``/``positions [B, T]`` int64 of ``rows``, right-padded (token 0 at position ``pad``): host arrays, or
    ``tokens`` a tensor on the device of rows whose tokens are a tensor there (packed there, never read back)."""
    layout = TargetLayout(tuple(r.slot for r in rows), tuple(r.start for r in rows), tuple(len(r.tokens) for r in rows))
    device = next((r.tokens.device for r in rows if isinstance(r.tokens, Tensor) and r.tokens.device.type != "cpu"),
                  None)
    if device is not None:
        tokens = torch.stack([F.pad(torch.as_tensor(r.tokens, dtype=torch.int64, device=device),
                                    (0, layout.width - len(r.tokens))) for r in rows])
    else:
        tokens = _padded_ids([r.tokens for r in rows], layout.width)
    return tokens, layout.position_array(pad), layout


def pack_draft(rows: list[DraftRow], pad: int) -> tuple[np.ndarray, np.ndarray, DraftLayout]:
    """Host arrays ``block [B, Bc]`` int64 (right-padded with 0) and ``positions [B, C + Bc]`` of each row's
    ``[context ; block]`` (context right-aligned, padding at ``pad``), and the rows' layout."""
    layout = DraftLayout(tuple(r.slot for r in rows), tuple(r.start for r in rows),
                         tuple(r.taps.shape[0] for r in rows), tuple(len(r.block) for r in rows))
    return _padded_ids([r.block for r in rows], layout.block_width), layout.position_array(pad), layout


def _padded_ids(rows: list, width: int) -> np.ndarray:
    """``[B, width]`` int64 of host id rows (lists or CPU tensors), right-padded with 0."""
    ids = np.zeros((len(rows), width), np.int64)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = row.numpy() if isinstance(row, Tensor) else row
    return ids


class GraphRows:
    """The calls of one backend's graphs over its slot caches, with every input buffer allocated at setup
    (docs/style.md R5): host-packed inputs are copied into the leading elements of flat device buffers, so each
    input is contiguous (an executor takes a bare address)."""

    def __init__(self, max_batch: int, max_seq_len: int, taps_width: int, device: torch.device,
                 numpy_io: bool = False) -> None:
        self.device = device
        self.numpy_io = numpy_io  # a host executor: inputs, outputs and cache write-backs as numpy arrays
        self.max_seq_len = max_seq_len  # padding sits at position S = max_seq_len (the caches' length)
        self._tokens = torch.zeros(max_batch * max_seq_len, dtype=torch.int64, device=device)
        self._positions = torch.zeros_like(self._tokens)
        self._context_positions = torch.zeros_like(self._tokens)
        self._lengths = torch.zeros(max_batch, dtype=torch.int64, device=device)
        # a DFlash2 drafter's walk: each row's temperature and its uniforms, one per draft slot
        self._temperatures = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self._uniforms = torch.zeros(max_batch * max_seq_len, dtype=torch.float32, device=device)
        # cache_positions: the first K rows of this arange are the live cache rows a forward reads (a view, no copy)
        self._cache_rows = (np.arange(max_seq_len, dtype=np.int64) if numpy_io
                            else torch.arange(max_seq_len, dtype=torch.int64, device=device))
        # the drafter's context features, [B, C, L*H] (C up to a prompt's length); on the host they are packed per
        # call instead: at real sizes (L*H ~ 5 x 4,096) this buffer would be gigabytes of host memory
        on_host = device.type == "cpu"
        self._taps = None if on_host else torch.zeros(max_batch * max_seq_len * max(1, taps_width), device=device)

    def _taps_buffer(self, shape: tuple[int, ...]) -> np.ndarray | Tensor:
        if self._taps is None:
            return np.zeros(shape, np.float32) if self.numpy_io else torch.zeros(shape)
        view = self._taps[:torch.Size(shape).numel()].view(shape)
        view.zero_()
        return view

    def _stage(self, buffer: Tensor, host: np.ndarray | Tensor) -> np.ndarray | Tensor:
        """``host`` (a fresh, contiguous host array or tensor) as the executor's input: itself for a host executor,
        else copied into the leading elements of the flat device ``buffer``, as a contiguous view of its shape."""
        if self.numpy_io:
            return host
        host = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
        view = buffer[:host.numel()].view(host.shape)
        view.copy_(host, non_blocking=True)
        return view

    def _array(self, tensor: Tensor) -> np.ndarray | Tensor:
        """A row's tensor (taps, on the backend's device) in the executor's kind of array (no copy)."""
        return tensor.numpy() if self.numpy_io else tensor

    def _live_rows(self, lengths: list[int]) -> Tensor:
        """``[K]``: the cache rows a forward reads, up to the longest committed prefix of its rows (at least one)."""
        return self._cache_rows[:max(1, max(lengths))]

    @staticmethod
    def _kept(executor: Executor, output: np.ndarray | Tensor) -> Tensor:
        """What the runtime gets of an output: a tensor of its own (a host array is shared, not copied)."""
        if isinstance(output, np.ndarray):
            return torch.from_numpy(output.copy() if executor.reuses_outputs else output)
        return output.clone() if executor.reuses_outputs else output

    def target(self, executor: Executor, cache: StaticKVCache, rows: list[TargetRow], with_taps: bool
               ) -> list[tuple[Tensor, Tensor | None]]:
        """``target.onnx``. Shapes per row: logits ``[T_i, V]`` (``[1, V]`` with ``last_only``), taps ``[T_i, L*H]``
        or None; on the cache's device."""
        for row in rows:
            assert row.start <= cache.lengths[row.slot], "target cache gap"
            assert row.start + len(row.tokens) <= self.max_seq_len, "target cache overflow"
        tokens, positions, layout = pack_target(rows, self.max_seq_len)
        starts = list(layout.starts)
        keys, values = cache.bound(list(layout.slots), max(1, max(starts)))
        outputs = executor.run({
            "tokens": self._stage(self._tokens, tokens), "positions": self._stage(self._positions, positions),
            "cache_positions": self._live_rows(starts),
            "cache_lengths": self._stage(self._lengths, np.array(starts, np.int64)),
            **_per_layer(keys, values)})
        results = []
        for index, row in enumerate(rows):
            count = len(row.tokens)
            cache.store(row.slot, row.start, outputs["new_keys"][index, :, :, :count],
                        outputs["new_values"][index, :, :, :count])
            logits = outputs["logits"][index, count - 1:count] if row.last_only else outputs["logits"][index, :count]
            taps = outputs["taps"][index, :count] if with_taps and "taps" in outputs else None
            results.append((self._kept(executor, logits), None if taps is None else self._kept(executor, taps)))
        return results

    def draft(self, executor: Executor, cache: StaticKVCache, rows: list[DraftRow]) -> list[Tensor]:
        """``draft.onnx``: every row in one call, or the rows taking in a prompt in a call of their own
        (``interface.intake_groups``: one call pads every row's context to the longest). Shapes per row: draft logits
        ``[Bc_i - 1, V]`` on the cache's device; afterwards each draft cache holds positions ``< start``."""
        def call(group: list[DraftRow]) -> list[Tensor]:
            outputs = self._draft_call(executor, cache, group, {})
            return [self._kept(executor, outputs["draft_logits"][index, :len(row.block) - 1])
                    for index, row in enumerate(group)]

        return by_intake(rows, call)

    def propose(self, executor: Executor, cache: StaticKVCache, rows: list[DraftRow], max_block: int | None = None
                ) -> list[DraftProposal]:
        """A DFlash2 drafter's ``draft.onnx`` (the candidate selector walked in the graph, ``export_onnx``'s
        ``SelectorDraftGraph``): every row in one call, greedy rows (temperature 0) and sampled ones (their uniforms)
        alike. Per row a :class:`DraftProposal` on the cache's device: tokens ``[Bc_i - 1]``, support and, for a
        sampled row, probs ``[Bc_i - 1, k]``. ``max_block``: the build's block length, over which the graph's walk is
        unrolled (a longer block is refused: the walk would stop short of it). Rows taking in a prompt are walked in a
        call of their own (``interface.intake_groups``)."""
        return by_intake(rows, lambda group: self._propose_call(executor, cache, group, max_block))

    def _propose_call(self, executor: Executor, cache: StaticKVCache, rows: list[DraftRow], max_block: int | None
                      ) -> list[DraftProposal]:
        width = max(len(row.block) for row in rows) - 1
        if max_block is not None and width + 1 > max_block:
            raise RequestError(f"block_len is {width + 1}; expected <= {max_block}, the block this engine's DFlash2 "
                               f"drafter graph walks its candidate selector over (build --block-len). Fix: pass "
                               f"block_len <= {max_block}, or rebuild the engine with --block-len {width + 1}.")
        temperatures = torch.tensor([row.temperature for row in rows], dtype=torch.float32)
        draws = self._uniforms[:len(rows) * width].view(len(rows), width)
        draws.zero_()
        for index, row in enumerate(rows):
            if row.temperature > 0 and row.uniforms is not None:
                draws[index, :row.uniforms.shape[0]] = row.uniforms
        outputs = self._draft_call(executor, cache, rows, {
            "temperature": self._stage(self._temperatures, temperatures), "uniforms": draws})
        results = []
        for index, row in enumerate(rows):
            count = len(row.block) - 1
            probs = outputs["proposal_probs"][index, :count] if row.temperature > 0 else None
            results.append(DraftProposal(self._kept(executor, outputs["draft_tokens"][index, :count]),
                                         self._kept(executor, outputs["candidates"][index, :count]),
                                         None if probs is None else self._kept(executor, probs)))
        return results

    def _draft_call(self, executor: Executor, cache: StaticKVCache, rows: list[DraftRow], extra: dict[str, Tensor]
                    ) -> dict[str, Tensor]:
        """One ``draft.onnx`` call over ``rows`` (plus the ``extra`` inputs): stores each row's context K/V and
        returns the graph's outputs."""
        block, positions, layout = pack_draft(rows, self.max_seq_len)
        context = max(1, layout.context_width)  # a graph input needs one column at least
        committed = [s - c for s, c in zip(layout.starts, layout.context_lens)]
        taps = self._taps_buffer((len(rows), context, rows[0].taps.shape[-1]))
        context_positions = np.full((len(rows), context), self.max_seq_len, np.int64)
        context_positions[:, context - layout.context_width:] = positions[:, :layout.context_width]
        for index, row in enumerate(rows):
            assert committed[index] <= cache.lengths[row.slot], "draft cache gap"
            assert row.start + len(row.block) <= self.max_seq_len, "draft cache overflow"
            if row.taps.shape[0]:  # right-aligned: the context ends right before the anchor
                taps[index, context - row.taps.shape[0]:] = self._array(row.taps)
        keys, values = cache.bound(list(layout.slots), max(1, max(committed)))
        outputs = executor.run({
            "block": self._stage(self._tokens, block),
            "block_positions": self._stage(self._positions, np.ascontiguousarray(positions[:, layout.context_width:])),
            "taps": taps, "context_positions": self._stage(self._context_positions, context_positions),
            "cache_positions": self._live_rows(committed),
            "cache_lengths": self._stage(self._lengths, np.array(committed, np.int64)), **extra,
            **_per_layer(keys, values)})
        for index, row in enumerate(rows):
            kept = slice(context - row.taps.shape[0], context)
            cache.store(row.slot, committed[index], outputs["context_keys"][index, :, :, kept],
                        outputs["context_values"][index, :, :, kept])
        return outputs

    def draft_plugin(self, executor: Executor, cache: StaticKVCache, rows: list[DraftRow]) -> list[Tensor]:
        """``draft_plugin.onnx`` (prefix I/O: ``past_keys [n, 1, nkv, P, d]`` -> ``context_keys [n, 1, nkv, c, d]``),
        one row per call."""
        results = []
        for row in rows:
            past = row.start - row.taps.shape[0]
            assert past <= cache.lengths[row.slot], "draft cache gap"
            keys, values = cache.prefix(row.slot, past)
            taps = self._taps_buffer((1, *row.taps.shape))
            taps[0] = self._array(row.taps)
            outputs = executor.run({"block": self._stage(self._tokens, np.array([row.block], np.int64)),
                                    "taps": taps, "past_keys": keys, "past_values": values})
            cache.store(row.slot, past, outputs["context_keys"][:, 0], outputs["context_values"][:, 0])
            results.append(self._kept(executor, outputs["draft_logits"][0, :len(row.block) - 1]))
        return results


def _per_layer(keys: list[Tensor], values: list[Tensor]) -> dict[str, Tensor]:
    """The graphs' per-layer cache inputs ``key_cache.{l}``/``value_cache.{l}``."""
    return ({f"key_cache.{layer}": tensor for layer, tensor in enumerate(keys)}
            | {f"value_cache.{layer}": tensor for layer, tensor in enumerate(values)})
