"""The ``onnxruntime`` backend: the engine's batched ONNX graphs on ONNX Runtime (CPU by default).

Each network keeps static float32 KV caches on the host with one slot per request, allocated at setup
(docs/style.md R5); ``builder/export_onnx.py`` describes the graphs' I/O.

* The target of an ONNX Runtime engine (``target_step.onnx``) owns layer-major caches ``[layers, max_batch, nkv,
  S, d]``: a run of consecutive slots is a view of each layer's buffer, bound through I/O binding as both the
  attention node's past input and its present output, so the graph reads and extends the cache in place
  (:class:`_InPlaceTarget`).
* The drafter, and the target graph of a TensorRT engine run here (``target.onnx``), own ``[max_batch, layers,
  nkv, S, d]`` caches: a run of consecutive slots is passed as a view (ONNX Runtime reads a contiguous input in
  place), scattered slots are gathered, and the K/V rows the graph returns are written at each row's positions
  (:class:`_Network`).

Cropping is bookkeeping, as in ``model/kv_cache.py``; the scheduler keeps active requests in slot order so a
batch is usually one run. The loop, verification and stats are the shared ones in ``runtime/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import BackendUnavailableError
from dflash_trt.model.kv_cache import CacheLayout, KVCachePlan
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.model.memory import require_fit

THREADS_ENV = "DFLASH_ORT_THREADS"
"""Intra-op threads of every session (unset: 1 for small models, else ONNX Runtime's default)."""

SMALL_MODEL_HIDDEN = 512
"""Below this hidden size a forward is a few microseconds of math per op: a thread pool only adds
synchronisation (measured on stories260K: 0.19 ms per decode step with 1 thread, 3-7x slower with 2
on a loaded 2-core machine), so such models run single-threaded unless DFLASH_ORT_THREADS says otherwise."""


def _session_options(quant_mode: str, small_model: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    # FP8 Q/DQ graphs are miscompiled by ORT's extended optimisations (docs/environment.md §5)
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if quant_mode != "none"
                                        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    threads = os.environ.get(THREADS_ENV)
    if threads:
        options.intra_op_num_threads = int(threads)
    elif small_model:
        options.intra_op_num_threads = 1
    return options


def open_session(path: Path, quant_mode: str = "none", small_model: bool = False):
    """An ``InferenceSession`` for one graph; a graph with ``DFlashBlockAttention`` nodes gets the custom op."""
    import onnx
    import onnxruntime as ort

    from dflash_trt.plugins.onnx_nodes import plugin_nodes, to_ort_domain

    options = _session_options(quant_mode, small_model)
    model = onnx.load(str(path), load_external_data=False)
    if not plugin_nodes(model):
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    from dflash_trt.plugins.onnxruntime.ops import register

    options.register_custom_ops_library(register())
    model = onnx.load(str(path))
    return ort.InferenceSession(to_ort_domain(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


class OrtBackend:
    """Target and drafter graphs over host-side static caches, ``max_batch`` slots (the batched protocol)."""

    name = "onnxruntime"
    device = "cpu"

    def __init__(self, target_config: TargetConfig, draft_config: DraftConfig | None, target_graph: Path,
                 draft_graph: Path | None, max_seq_len: int, quant_mode: str = "none", max_batch: int = 1) -> None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(f"backend 'onnxruntime' needs the onnxruntime package ({exc}). Fix: "
                                          "pip install 'dflash-trt[onnx]', or pass --backend torch.") from None
        self.target_config = target_config
        self.draft_config = draft_config
        self.dtype = torch.float32
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        small = target_config.hidden_size < SMALL_MODEL_HIDDEN
        target_session = open_session(target_graph, quant_mode, small)
        draft_session = None
        if draft_graph is not None and draft_config is not None:
            draft_session = open_session(draft_graph, quant_mode, small)
        # sized before anything is allocated: in-place graphs own K and V; the others also keep gather buffers
        layouts = [None if graph is None else CacheLayout.of(config, self.dtype, extra_rows=0,
                                                             per_slot_buffers=2 if _in_place(graph) else 4)
                   for config, graph in ((target_config, target_session), (draft_config, draft_session))]
        dtype = str(self.dtype).removeprefix("torch.")
        self.kv_cache = KVCachePlan(layouts[0], layouts[1], max_batch, max_seq_len, dtype)
        require_fit(self.kv_cache)
        shape = (max_batch, target_config.num_layers, target_config.num_kv_heads, max_seq_len, target_config.head_dim)
        self._target = (_InPlaceTarget(target_session, shape) if _in_place(target_session)
                        else _Network(target_session, *shape))
        self._draft = None
        if draft_session is not None:
            shape = (max_batch, draft_config.num_layers, draft_config.num_kv_heads, max_seq_len, draft_config.head_dim)
            self._draft = (_InPlaceDrafter(draft_session, shape) if _in_place(draft_session)
                           else _Network(draft_session, *shape))

    def reset_slot(self, slot: int) -> None:
        self._target.lengths[slot] = 0
        if self._draft is not None:
            self._draft.lengths[slot] = 0

    def crop_target_slot(self, slot: int, length: int) -> None:
        self._target.lengths[slot] = min(self._target.lengths[slot], length)

    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        """Shapes per row: logits ``[T_i, V]`` (``[1, V]`` with ``last_only``), taps ``[T_i, L*H]`` or None."""
        for row in rows:
            assert row.start <= self._target.lengths[row.slot], "target cache gap"
            assert row.start + len(row.tokens) <= self.max_seq_len, "target cache overflow"
        if isinstance(self._target, _InPlaceTarget):
            return self._target.run_rows(rows, with_taps)
        pad = self.max_seq_len  # padding sits past every real position (export_onnx)
        width = max(len(r.tokens) for r in rows)
        tokens = np.zeros((len(rows), width), np.int64)
        positions = np.full((len(rows), width), pad, np.int64)
        for index, row in enumerate(rows):
            tokens[index, :len(row.tokens)] = row.tokens
            positions[index, :len(row.tokens)] = np.arange(row.start, row.start + len(row.tokens))
        lengths = np.array([r.start for r in rows], np.int64)
        outputs = self._target.run({"tokens": tokens, "positions": positions, "cache_positions": _live_rows(lengths),
                                    "cache_lengths": lengths}, [r.slot for r in rows])
        results = []
        for index, row in enumerate(rows):
            count = len(row.tokens)
            self._target.store(row.slot, row.start, outputs["new_keys"][index, :, :, :count],
                               outputs["new_values"][index, :, :, :count])
            logits = outputs["logits"][index, count - 1:count] if row.last_only else outputs["logits"][index, :count]
            taps = outputs.get("taps")
            results.append((torch.from_numpy(logits),
                            torch.from_numpy(taps[index, :count]) if with_taps and taps is not None else None))
        return results

    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        """Shapes per row: draft logits ``[Bc_i - 1, V]``; afterwards each draft cache holds positions ``< start``."""
        assert self._draft is not None, "draft_batch() needs a drafter graph"
        for row in rows:
            assert row.start + len(row.block) <= self.max_seq_len, "draft cache overflow"
        if isinstance(self._draft, _InPlaceDrafter):
            return [self._draft.run_row(row) for row in rows]
        if self._draft.prefix_io:
            return [self._draft_one_with_op_graph(row) for row in rows]
        pad = self.max_seq_len
        block_width = max(len(r.block) for r in rows)
        context_width = max(1, max(r.taps.shape[0] for r in rows))  # a graph input needs one column at least
        features = rows[0].taps.shape[-1]
        block = np.zeros((len(rows), block_width), np.int64)
        block_positions = np.full((len(rows), block_width), pad, np.int64)
        taps = np.zeros((len(rows), context_width, features), np.float32)
        context_positions = np.full((len(rows), context_width), pad, np.int64)
        lengths = np.zeros(len(rows), np.int64)
        for index, row in enumerate(rows):
            context = row.taps.shape[0]
            past = row.start - context
            assert past <= self._draft.lengths[row.slot], "draft cache gap"
            block[index, :len(row.block)] = row.block
            block_positions[index, :len(row.block)] = np.arange(row.start, row.start + len(row.block))
            if context:  # right-aligned: the context ends right before the anchor
                taps[index, context_width - context:] = row.taps.numpy()
                context_positions[index, context_width - context:] = np.arange(past, row.start)
            lengths[index] = past
        outputs = self._draft.run({"block": block, "block_positions": block_positions, "taps": taps,
                                   "context_positions": context_positions, "cache_positions": _live_rows(lengths),
                                   "cache_lengths": lengths},
                                  [r.slot for r in rows])
        results = []
        for index, row in enumerate(rows):
            context = row.taps.shape[0]
            keep = slice(context_width - context, context_width)
            self._draft.store(row.slot, row.start - context, outputs["context_keys"][index, :, :, keep],
                              outputs["context_values"][index, :, :, keep])
            results.append(torch.from_numpy(outputs["draft_logits"][index, :len(row.block) - 1]))
        return results


    def _draft_one_with_op_graph(self, row: DraftRow) -> Tensor:
        """The plugin-node drafter (``draft_plugin.onnx``, prefix I/O, TensorRT's graph) run for one row: on ONNX
        Runtime it checks the custom op's parity, it is not a fast path (the cache prefix is copied in)."""
        context = row.taps.shape[0]
        past = row.start - context
        network = self._draft
        feeds = {"block": np.array([row.block], np.int64), "taps": row.taps.numpy().astype(np.float32)[None],
                 "past_keys": np.ascontiguousarray(network.keys[row.slot, :, :, :past][:, None]),
                 "past_values": np.ascontiguousarray(network.values[row.slot, :, :, :past][:, None])}
        logits, keys, values = network.session.run(None, feeds)
        network.store(row.slot, past, keys[:, 0], values[:, 0])
        return torch.from_numpy(logits[0])


def _in_place(session) -> bool:
    """Whether a graph extends its cache buffers in place (``target_step.onnx``, ``draft_step.onnx``): they take
    ``seqlens_k``, the graphs that return new K/V rows do not."""
    return "seqlens_k" in {i.name for i in session.get_inputs()}


class _Binding:
    """One call shape of an in-place graph, bound once: ``inputs`` and ``outputs`` are buffers bound by name (filled
    and read per call), and each layer's cache view of ``count`` slots from ``first`` is bound as both its past input
    and its present output, so the graph's attention nodes extend it in place (no copy)."""

    def __init__(self, session, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                 caches: tuple[np.ndarray, np.ndarray], first: int, count: int) -> None:
        self.io = session.io_binding()
        self.inputs, self.outputs = inputs, outputs
        for name, array in inputs.items():
            self._bind(self.io.bind_input, name, array)
        for name, array in outputs.items():
            self._bind(self.io.bind_output, name, array)
        self.caches = []
        for kind, cache in zip(("key", "value"), caches):
            for layer in range(len(cache)):
                view = cache[layer, first:first + count]
                self._bind(self.io.bind_input, f"{kind}_cache.{layer}", view)
                self._bind(self.io.bind_output, f"present_{kind}.{layer}", view)
                self.caches.append(view)

    @staticmethod
    def _bind(bind, name: str, array: np.ndarray) -> None:
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


class _InPlaceGraph:
    """A graph over layer-major slot caches ``[layers, max_batch, nkv, S, d]`` that its attention nodes read and extend
    in place, with each call shape's binding kept (least recently used dropped past ``KEPT_BINDINGS``)."""

    KEPT_BINDINGS = 64

    def __init__(self, session, shape: tuple[int, int, int, int, int]) -> None:
        max_batch, layers, kv_heads, max_len, head_dim = shape
        self.session = session
        self.keys = np.zeros((layers, max_batch, kv_heads, max_len, head_dim), np.float32)
        self.values = np.zeros_like(self.keys)
        self.lengths = [0] * max_batch
        self.input_names = {i.name for i in session.get_inputs()}
        self.output_widths = {o.name: o.shape[-1] for o in session.get_outputs() if not o.name.startswith("present")}
        self._bindings: dict[tuple, _Binding] = {}

    def binding(self, first: int, count: int, shape: tuple, buffers) -> _Binding:
        """The binding of ``count`` slots from ``first`` for call ``shape``; ``buffers()`` -> (inputs, outputs) makes
        a new one's buffers."""
        key = (first, count) + shape
        binding = self._bindings.pop(key, None)
        if binding is None:
            binding = _Binding(self.session, *buffers(), (self.keys, self.values), first, count)
            if len(self._bindings) >= self.KEPT_BINDINGS:
                self._bindings.pop(next(iter(self._bindings)))
        self._bindings[key] = binding  # most recently used last
        return binding


class _InPlaceTarget(_InPlaceGraph):
    """The target's ``target_step.onnx`` (``builder/export_onnx.py``, :class:`StepGraph`).

    A call covers a range of slots; its rows are right-padded to the widest and the slots without a row are idle
    entries (``query_seqlens``), so decode steps, verification blocks and prompts of many requests share calls
    (:func:`plan_calls`). Graphs without ``query_seqlens`` (format 3 engines) take runs of consecutive slots and run a
    row adding several tokens alone, as ONNX Runtime's kernel then requires."""

    def __init__(self, session, shape: tuple[int, int, int, int, int]) -> None:
        super().__init__(session, shape)
        self.padded_rows = "query_seqlens" in self.input_names

    def run_rows(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        results: list[tuple[Tensor, Tensor | None] | None] = [None] * len(rows)
        spans = [(row.slot, row.start, len(row.tokens)) for row in rows]
        for group in plan_calls(spans, self.keys.shape[3], self.padded_rows):
            self._run([rows[i] for i in group], with_taps, results, group)
        return results

    def _buffers(self, count: int, width: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        inputs = {"tokens": np.zeros((count, width), np.int64), "positions": np.zeros((count, width), np.int64),
                  "seqlens_k": np.zeros(count, np.int32), "total_length": np.zeros((), np.int32),
                  "query_seqlens": np.zeros(count, np.int32)}
        inputs = {name: array for name, array in inputs.items() if name in self.input_names}
        return inputs, {name: np.zeros((count, width, size), np.float32) for name, size in self.output_widths.items()}

    def _run(self, rows: list[TargetRow], with_taps: bool, results: list, indices: list[int]) -> None:
        """One call over the slots from ``rows[0]``'s to ``rows[-1]``'s (rows sorted by slot); a slot between them
        without a row is an idle entry (``query_seqlens`` 0: nothing written, its outputs ignored)."""
        first = rows[0].slot
        entries = [row.slot - first for row in rows]  # each row's entry in the call
        widths = np.array([len(row.tokens) for row in rows])
        width, count = int(widths.max()), entries[-1] + 1
        bound = self.binding(first, count, (width,), lambda: self._buffers(count, width))
        inputs = bound.inputs
        starts = np.array([row.start for row in rows], np.int64)
        if count > len(rows):  # (query_seqlens graphs only, plan_calls) an idle entry: one unread row, none new
            inputs["seqlens_k"][:] = 0
            inputs["query_seqlens"][:] = 0
        at = entries if count > len(rows) else slice(None)
        if widths.min() == width:
            inputs["tokens"][at] = [row.tokens for row in rows]
            inputs["positions"][at] = starts[:, None] + np.arange(width)
        else:  # right padding keeps the binding's earlier valid tokens and positions (never written, never read)
            for entry, row in zip(entries, rows):
                inputs["tokens"][entry, :len(row.tokens)] = row.tokens
                inputs["positions"][entry, :len(row.tokens)] = np.arange(row.start, row.start + len(row.tokens))
        inputs["seqlens_k"][at] = starts + widths - 1
        if self.padded_rows:
            inputs["query_seqlens"][at] = widths
        inputs["total_length"][...] = (starts + widths).max()
        self.session.run_with_iobinding(bound.io)
        logits, taps = bound.outputs["logits"], bound.outputs.get("taps")
        for entry, index, row in zip(entries, indices, rows):
            tokens = len(row.tokens)
            self.lengths[row.slot] = row.start + tokens
            kept = slice(tokens - 1, tokens) if row.last_only else slice(0, tokens)
            results[index] = (torch.from_numpy(logits[entry, kept].copy()),  # the buffers are reused
                              torch.from_numpy(taps[entry, :tokens].copy()) if with_taps and taps is not None
                              else None)


class _InPlaceDrafter(_InPlaceGraph):
    """The drafter's ``draft_step.onnx`` (``builder/export_onnx.py``, :class:`DraftStepGraph`), one request per call:
    ONNX Runtime's kernel takes several new rows after a past for one row only, and bidirectional attention has no
    right padding. Each call writes the new context rows (and the block's, which the next call overwrites) after
    the committed ones and commits the cache up to the anchor."""

    def __init__(self, session, shape: tuple[int, int, int, int, int]) -> None:
        super().__init__(session, shape)
        self.taps_width = next(i.shape[-1] for i in session.get_inputs() if i.name == "taps")

    def _buffers(self, context: int, width: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        inputs = {"block": np.zeros((1, width), np.int64), "block_positions": np.zeros((1, width), np.int64),
                  "taps": np.zeros((1, context, self.taps_width), np.float32),
                  "context_positions": np.zeros((1, context), np.int64), "seqlens_k": np.zeros(1, np.int32),
                  "total_length": np.zeros((), np.int32)}
        return inputs, {"draft_logits": np.zeros((1, width - 1, self.output_widths["draft_logits"]), np.float32)}

    def run_row(self, row: DraftRow) -> Tensor:
        """Shapes: draft logits ``[Bc - 1, V]``."""
        context, width = row.taps.shape[0], len(row.block)
        past = row.start - context
        assert context >= 1 and past <= self.lengths[row.slot], "draft cache gap"
        bound = self.binding(row.slot, 1, (context, width), lambda: self._buffers(context, width))
        inputs = bound.inputs
        inputs["block"][0] = row.block
        inputs["block_positions"][0] = np.arange(row.start, row.start + width)
        inputs["taps"][0] = row.taps.numpy()
        inputs["context_positions"][0] = np.arange(past, row.start)
        inputs["seqlens_k"][0] = row.start + width - 1
        inputs["total_length"][...] = row.start + width
        self.session.run_with_iobinding(bound.io)
        self.lengths[row.slot] = row.start
        return torch.from_numpy(bound.outputs["draft_logits"][0].copy())


MAX_PADDING = 0.5
"""Largest share of a call's padded rows that may be padding (right-padding costs the same as real rows)."""


def plan_calls(spans: list[tuple[int, int, int]], capacity: int, padded_rows: bool = True) -> list[list[int]]:
    """Which rows share a ``target_step.onnx`` call: indices into ``spans`` (``(slot, start, width)`` per row), sorted
    by slot. A call covers the slots from its first row's to its last row's, right-padded to its widest row; with
    ``padded_rows`` (``query_seqlens``) a slot in between without a row is an idle entry, without it a call is a run
    of consecutive slots and a wider row runs alone. One-token rows and wider rows go to separate calls; a row joins a
    call while at most ``MAX_PADDING`` of the call's rows would be padding (right padding and idle entries: they cost
    what real rows cost) and every row's padded chunk fits the cache (``start + width <= capacity``, the kernel's
    rule)."""
    calls: list[list[int]] = []
    for one_token in (True, False):
        members = sorted((i for i, span in enumerate(spans) if (span[2] == 1) == one_token), key=lambda i: spans[i][0])
        call: list[int] = []
        widest = useful = latest = 0  # the call's widest row, its real rows, its latest start
        for index in members:
            slot, start, width = spans[index]
            if call:
                padded = max(width, widest)
                entries = slot - spans[call[0]][0] + 1
                joins = ((padded_rows or (one_token and spans[call[-1]][0] + 1 == slot))
                         and padded * entries * (1 - MAX_PADDING) <= useful + width
                         and max(start, latest, 1) + padded <= capacity)  # an idle entry holds one row
                if joins:
                    call.append(index)
                    widest, useful, latest = padded, useful + width, max(start, latest)
                    continue
                calls.append(call)
            call, widest, useful, latest = [index], width, width, start
        if call:
            calls.append(call)
    return calls


def _live_rows(lengths: np.ndarray) -> np.ndarray:
    """``[K]`` positions of the cache rows a forward reads: up to the longest committed prefix among its rows
    (at least one row, masked when nothing is committed), so attention grows with the context, not ``S``."""
    return np.arange(max(1, int(lengths.max())), dtype=np.int64)


class _Network:
    """One graph, its slot caches ``[max_batch, layers, nkv, S, d]`` and their committed lengths."""

    def __init__(self, session, max_batch: int, layers: int, kv_heads: int, max_len: int, head_dim: int) -> None:
        self.session = session
        self.output_names = [o.name for o in session.get_outputs()]
        self.prefix_io = "past_keys" in {i.name for i in session.get_inputs()}  # the plugin-node drafter graph
        shape = (max_batch, layers, kv_heads, max_len, head_dim)
        self.keys = np.zeros(shape, np.float32)
        self.values = np.zeros(shape, np.float32)
        self.gather_keys = np.zeros(shape, np.float32)  # rows of non-contiguous slots are gathered here
        self.gather_values = np.zeros(shape, np.float32)
        self.lengths = [0] * max_batch

    def _bound_caches(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return self.keys[first:first + len(slots)], self.values[first:first + len(slots)]  # views, no copy
        batch = len(slots)
        np.take(self.keys, slots, axis=0, out=self.gather_keys[:batch])
        np.take(self.values, slots, axis=0, out=self.gather_values[:batch])
        return self.gather_keys[:batch], self.gather_values[:batch]

    def run(self, feeds: dict[str, np.ndarray], slots: list[int]) -> dict[str, np.ndarray]:
        keys, values = self._bound_caches(slots)
        # On the CPU provider ONNX Runtime reads a C-contiguous float32 numpy input in place (no copy: a 16-slot,
        # 5 MiB cache view runs in the same time either way); I/O binding does the same at ~50 us more Python per
        # call (measured on stories260K, 1 thread), so the plain run() is the binding.
        outputs = self.session.run(self.output_names, {**feeds, "key_cache": keys, "value_cache": values})
        return dict(zip(self.output_names, outputs))

    def store(self, slot: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Write new rows ``[layers, nkv, n, d]`` at positions ``start ..`` of ``slot``; commit them."""
        end = start + keys.shape[2]
        self.keys[slot, :, :, start:end] = keys
        self.values[slot, :, :, start:end] = values
        self.lengths[slot] = end
