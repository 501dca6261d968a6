"""The ``tensorrt`` backend: the engine's TensorRT plans over device-resident slot caches (GPU only).

The plans are built from the same batched ONNX graphs as the ``onnxruntime`` backend (``builder/export_onnx.py``
describes their I/O). Each network keeps one static KV cache on the GPU, ``[max_batch, layers, nkv, S, d]``
(one slot per request), allocated at setup with every input and gather buffer (docs/style.md R5). A forward binds
the cache rows of its requests in place (a contiguous run of slots is a view; other sets are gathered into a
preallocated buffer), runs ``execute_async_v3`` on the current CUDA stream and writes back only the K/V rows
the plan returns. Logits, taps and drafts stay on the GPU (``device``): the backend makes no
device-to-host copy, so the runtime's acceptance readback is the step's one host transfer. A drafter plan
built from ``draft_plugin.onnx`` (``DFlashBlockAttention`` nodes, prefix I/O) runs row by row, since its
rows must share one context length.

Order of operations is a safety rule: the GPU is checked *before* ``tensorrt`` is imported or any runtime
object exists, because deserialising without a GPU crashes the process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from dflash_trt.errors import BackendUnavailableError, EngineFormatError
from dflash_trt.model.kv_cache import CacheLayout, KVCachePlan
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.model.memory import require_fit


class Plan(Protocol):
    """Executes one network: named input tensors (on ``device``) -> named output tensors (on ``device``).

    Outputs may be views of buffers the next ``run`` overwrites."""

    input_names: frozenset[str]

    def run(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]: ...


class TensorRTPlan:
    """One deserialised plan, its execution context and output buffers at the profile's maximum shapes."""

    def __init__(self, runtime, path: Path, max_shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        import tensorrt as trt

        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise EngineFormatError(f"{path}: TensorRT could not deserialise the plan (see the TensorRT log). Fix: "
                                    "rebuild the engine on this machine with `dflash-trt build --backend tensorrt`.")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = frozenset(n for n in names if is_input[n])
        missing = [n for n in names if not is_input[n] and n not in max_shapes]
        if missing:
            raise EngineFormatError(f"{path}: the plan has outputs {missing} this backend does not know. Fix: rebuild "
                                    "the engine with this version of dflash-trt.")
        self.outputs = {n: torch.empty(max_shapes[n], dtype=torch.float32, device=device)
                        for n in names if not is_input[n]}

    def run(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        for name, tensor in inputs.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        results = {}
        for name, buffer in self.outputs.items():
            shape = tuple(self.context.get_tensor_shape(name))
            view = buffer.view(-1)[:torch.Size(shape).numel()].view(shape)
            self.context.set_tensor_address(name, view.data_ptr())
            results[name] = view
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise BackendUnavailableError("TensorRT execute_async_v3 failed (see the TensorRT log).")
        return results


class _SlotCache:
    """One network's KV cache ``[max_batch, layers, nkv, S, d]``, its gather buffers and committed lengths."""

    def __init__(self, max_batch: int, layers: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device) -> None:
        shape = (max_batch, layers, kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.gather_keys = torch.zeros(shape, device=device)  # rows of non-contiguous slots are gathered here
        self.gather_values = torch.zeros(shape, device=device)
        self.prefix_keys = torch.zeros(layers * max_len * kv_heads * head_dim, device=device)  # plugin graph input
        self.prefix_values = torch.zeros_like(self.prefix_keys)
        self.lengths = [0] * max_batch

    def bound(self, slots: list[int]) -> tuple[Tensor, Tensor]:
        """The caches of ``slots`` as ``[B, layers, nkv, S, d]``: a view when the slots are consecutive."""
        first, batch = slots[0], len(slots)
        if slots == list(range(first, first + batch)):
            return self.keys[first:first + batch], self.values[first:first + batch]
        index = torch.tensor(slots, device=self.keys.device)
        torch.index_select(self.keys, 0, index, out=self.gather_keys[:batch])
        torch.index_select(self.values, 0, index, out=self.gather_values[:batch])
        return self.gather_keys[:batch], self.gather_values[:batch]

    def prefix(self, slot: int, rows: int) -> tuple[Tensor, Tensor]:
        """Rows ``< rows`` of ``slot`` copied contiguously as ``[layers, 1, nkv, rows, d]`` (plugin graph I/O)."""
        source_keys, source_values = self.keys[slot, :, :, :rows], self.values[slot, :, :, :rows]
        keys = self.prefix_keys[:source_keys.numel()].view(source_keys.shape)
        values = self.prefix_values[:source_values.numel()].view(source_values.shape)
        keys.copy_(source_keys)
        values.copy_(source_values)
        return keys.unsqueeze(1), values.unsqueeze(1)

    def store(self, slot: int, start: int, keys: Tensor, values: Tensor) -> None:
        """Write new rows ``[layers, nkv, n, d]`` at positions ``start ..`` of ``slot``; commit them."""
        end = start + keys.shape[2]
        self.keys[slot, :, :, start:end] = keys
        self.values[slot, :, :, start:end] = values
        self.lengths[slot] = end


class TensorRTBackend:
    """Target and drafter plans over device slot caches, ``max_batch`` slots (the batched protocol).

    ``plans`` (target, drafter) replaces the engine's TensorRT plans with other executors of the same I/O on
    ``device``; without it the plans are deserialised from ``engine`` on ``cuda:0``."""

    name = "tensorrt"

    def __init__(self, pair, engine, max_seq_len: int, max_batch: int = 1,
                 plans: tuple[Plan, Plan | None] | None = None, device: str = "cuda:0") -> None:
        if plans is None:
            from dflash_trt.plugins.tensorrt.device import gpu_info, needs_message

            if gpu_info() is None:  # before any TensorRT object: a GPU-less runtime crashes on deserialise
                raise BackendUnavailableError(needs_message("the tensorrt backend") + ". Fix: use --backend "
                                              "onnxruntime.")
        self.device = str(torch.device(device))
        self.dtype = torch.float32
        self.target_config = pair.target.config
        self.draft_config = pair.draft.config if pair.draft is not None else None
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        if plans is None:
            plans = self._load_plans(engine)
        self._target, self._draft = plans
        device_ = torch.device(self.device)
        t = self.target_config
        # _SlotCache: K, V and their gather buffers per slot, plus the plugin graph's prefix K and V (not per slot)
        layouts = [None if config is None else CacheLayout.of(config, self.dtype, extra_rows=0, per_slot_buffers=4,
                                                              shared_buffers=2)
                   for config in (t, self.draft_config if self._draft is not None else None)]
        dtype = str(self.dtype).removeprefix("torch.")
        self.kv_cache = KVCachePlan(layouts[0], layouts[1], max_batch, max_seq_len, dtype, self.device)
        require_fit(self.kv_cache)  # before allocating, with the numbers (docs/style.md R5)
        self._target_cache = _SlotCache(max_batch, t.num_layers, t.num_kv_heads, max_seq_len, t.head_dim, device_)
        self._draft_cache = None
        if self.draft_config is not None and self._draft is not None:
            d = self.draft_config
            self._draft_cache = _SlotCache(max_batch, d.num_layers, d.num_kv_heads, max_seq_len, d.head_dim, device_)
        width = max(1, self._tap_width())  # [L*H] of the drafter's context features
        # inputs, assembled on the host each step and copied in (one small host-to-device copy per input)
        self._tokens = torch.zeros(max_batch, max_seq_len, dtype=torch.int64, device=device_)
        self._positions = torch.zeros_like(self._tokens)
        self._context_positions = torch.zeros_like(self._tokens)
        self._lengths = torch.zeros(max_batch, dtype=torch.int64, device=device_)
        # cache_positions: the first K rows of this arange are the live cache rows a forward reads (a view, no copy)
        self._cache_rows = torch.arange(max_seq_len, dtype=torch.int64, device=device_)
        self._taps = torch.zeros(max_batch, max_seq_len, width, device=device_)

    def _load_plans(self, engine) -> tuple[Plan, Plan | None]:
        import tensorrt as trt

        manifest = engine.manifest
        self._logger = trt.Logger(trt.Logger.WARNING)
        if manifest.tensorrt.plugin_library:
            library = engine.folder / manifest.tensorrt.plugin_library
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
            trt.get_plugin_registry().load_library(str(library))
        self._runtime = trt.Runtime(self._logger)
        t, d = self.target_config, self.draft_config
        batch, seq, block = self.max_batch, self.max_seq_len, manifest.build.block_len
        target = TensorRTPlan(self._runtime, engine.path_of("target_plan"), {
            "logits": (batch, seq, t.vocab_size), "taps": (batch, seq, max(1, self._tap_width())),
            "new_keys": (batch, t.num_layers, t.num_kv_heads, seq, t.head_dim),
            "new_values": (batch, t.num_layers, t.num_kv_heads, seq, t.head_dim)}, torch.device(self.device))
        if d is None:
            return target, None
        context = (batch, d.num_layers, d.num_kv_heads, seq, d.head_dim)
        draft = TensorRTPlan(self._runtime, engine.path_of("draft_plan"), {
            "draft_logits": (batch, block, t.vocab_size), "context_keys": context, "context_values": context},
            torch.device(self.device))
        return target, draft

    def _tap_width(self) -> int:
        d = self.draft_config
        return d.num_taps * self.target_config.hidden_size if d is not None else 0

    def reset_slot(self, slot: int) -> None:
        self._target_cache.lengths[slot] = 0
        if self._draft_cache is not None:
            self._draft_cache.lengths[slot] = 0

    def crop_target_slot(self, slot: int, length: int) -> None:
        self._target_cache.lengths[slot] = min(self._target_cache.lengths[slot], length)

    def _stage(self, buffer: Tensor, host: Tensor) -> Tensor:
        """``host`` copied into the leading corner of the preallocated device ``buffer``."""
        view = buffer[tuple(slice(0, n) for n in host.shape)]
        view.copy_(host, non_blocking=True)
        return view

    def _live_rows(self, lengths) -> Tensor:
        """``[K]``: the cache rows a forward reads, up to the longest committed prefix of its rows (at least one)."""
        return self._cache_rows[:max(1, max(lengths))]

    @torch.inference_mode()
    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        """Shapes per row: logits ``[T_i, V]`` (``[1, V]`` with ``last_only``), taps ``[T_i, L*H]`` or None;
        on ``device``."""
        cache = self._target_cache
        width = max(len(r.tokens) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        positions = torch.full((len(rows), width), self.max_seq_len, dtype=torch.int64)  # padding past every row
        for index, row in enumerate(rows):
            assert row.start <= cache.lengths[row.slot], "target cache gap"
            assert row.start + len(row.tokens) <= self.max_seq_len, "target cache overflow"
            tokens[index, :len(row.tokens)] = torch.tensor(row.tokens)
            positions[index, :len(row.tokens)] = torch.arange(row.start, row.start + len(row.tokens))
        keys, values = cache.bound([r.slot for r in rows])
        outputs = self._target.run({
            "tokens": self._stage(self._tokens, tokens), "positions": self._stage(self._positions, positions),
            "cache_positions": self._live_rows(r.start for r in rows),
            "cache_lengths": self._stage(self._lengths, torch.tensor([r.start for r in rows])),
            "key_cache": keys, "value_cache": values})
        results = []
        for index, row in enumerate(rows):
            count = len(row.tokens)
            cache.store(row.slot, row.start, outputs["new_keys"][index, :, :, :count],
                        outputs["new_values"][index, :, :, :count])
            logits = outputs["logits"][index, count - 1:count] if row.last_only else outputs["logits"][index, :count]
            taps = outputs["taps"][index, :count].clone() if with_taps and "taps" in outputs else None
            results.append((logits.clone(), taps))  # clones: the plan's buffers are reused by the next forward
        return results

    @torch.inference_mode()
    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        """Shapes per row: draft logits ``[Bc_i - 1, V]`` on ``device``; afterwards each draft cache holds
        positions ``< start``."""
        assert self._draft is not None and self._draft_cache is not None, "draft_batch() needs a drafter plan"
        if "past_keys" in self._draft.input_names:
            return [self._draft_one_with_plugin_graph(row) for row in rows]
        cache = self._draft_cache
        block_width = max(len(r.block) for r in rows)
        context_width = max(1, max(r.taps.shape[0] for r in rows))  # a plan input needs one column at least
        block = torch.zeros(len(rows), block_width, dtype=torch.int64)
        block_positions = torch.full((len(rows), block_width), self.max_seq_len, dtype=torch.int64)
        context_positions = torch.full((len(rows), context_width), self.max_seq_len, dtype=torch.int64)
        taps = self._taps[:len(rows), :context_width]  # [B, C, L*H], rows right-aligned
        taps.zero_()
        for index, row in enumerate(rows):
            context = row.taps.shape[0]
            past = row.start - context
            assert past <= cache.lengths[row.slot], "draft cache gap"
            assert row.start + len(row.block) <= self.max_seq_len, "draft cache overflow"
            block[index, :len(row.block)] = torch.tensor(row.block)
            block_positions[index, :len(row.block)] = torch.arange(row.start, row.start + len(row.block))
            if context:  # right-aligned: the context ends right before the anchor
                taps[index, context_width - context:] = row.taps
                context_positions[index, context_width - context:] = torch.arange(past, row.start)
        keys, values = cache.bound([r.slot for r in rows])
        outputs = self._draft.run({
            "block": self._stage(self._tokens, block), "block_positions": self._stage(self._positions, block_positions),
            "taps": taps, "context_positions": self._stage(self._context_positions, context_positions),
            "cache_positions": self._live_rows(r.start - r.taps.shape[0] for r in rows),
            "cache_lengths": self._stage(self._lengths, torch.tensor([r.start - r.taps.shape[0] for r in rows])),
            "key_cache": keys, "value_cache": values})
        results = []
        for index, row in enumerate(rows):
            context = row.taps.shape[0]
            keep = slice(context_width - context, context_width)
            cache.store(row.slot, row.start - context, outputs["context_keys"][index, :, :, keep],
                        outputs["context_values"][index, :, :, keep])
            results.append(outputs["draft_logits"][index, :len(row.block) - 1].clone())
        return results

    def _draft_one_with_plugin_graph(self, row: DraftRow) -> Tensor:
        """One row through the plugin-node drafter (``draft_plugin.onnx``: prefix I/O, ``past_keys [n, 1, nkv, P,
        d]``, ``context_keys [n, 1, nkv, c, d]``)."""
        cache = self._draft_cache
        context = row.taps.shape[0]
        past = row.start - context
        keys, values = cache.prefix(row.slot, past)
        block = torch.tensor([row.block], dtype=torch.int64)
        outputs = self._draft.run({"block": self._stage(self._tokens, block),
                                   "taps": self._stage(self._taps, row.taps.unsqueeze(0)),
                                   "past_keys": keys, "past_values": values})
        cache.store(row.slot, past, outputs["context_keys"][:, 0], outputs["context_values"][:, 0])
        return outputs["draft_logits"][0, :len(row.block) - 1].clone()
