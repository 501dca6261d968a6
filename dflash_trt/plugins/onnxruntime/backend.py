"""The ``onnxruntime`` backend: the engine's batched ONNX graphs on ONNX Runtime (CPU by default).

Each network keeps the one slot cache (``model/kv_cache.py``: float32, layer-major ``[layers, max_batch, nkv, S,
d]``, one slot per request) on the host, allocated at setup (docs/style.md R5); ``builder/export_onnx.py``
describes the graphs' I/O and the engine's manifest declares which ones it holds (``graphs``).

* The target of an ONNX Runtime engine (``target_step.onnx``): a run of consecutive slots is a view of each layer's
  buffer, bound through I/O binding as both the attention node's past input and its present output, so the graph
  reads and extends the cache in place (:class:`_InPlaceTarget`).
* The drafter (``draft.onnx``: every drafting row in one call), and the target graph of a TensorRT engine run here
  (``target.onnx``), return the K/V rows they add; ``plugins/graph_rows.py`` binds, packs and writes back for them
  exactly as for the TensorRT backend. A draft call of one row runs ``draft_step.onnx`` in place instead when the
  engine holds it (:class:`_InPlaceDrafter`: a drafter with full-attention layers only).

Cropping is bookkeeping, as in ``model/kv_cache.py``; the scheduler keeps active requests in slot order so a
batch is usually one run. The loop, verification and stats are the shared ones in ``runtime/``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import BackendUnavailableError
from dflash_trt.model.kv_cache import CacheLayout, KVCachePlan, SlotCaches, StaticKVCache
from dflash_trt.plugins.graph_rows import GraphRows, pack_target
from dflash_trt.plugins.interface import DraftProposal, DraftRow, TargetRow
from dflash_trt.model.memory import require_fit

if TYPE_CHECKING:
    from dflash_trt.formats.manifest import GraphVariants

THREADS_ENV = "DFLASH_ORT_THREADS"
"""Intra-op threads of every session (unset: 1 for small models, else ONNX Runtime's default)."""

SMALL_MODEL_HIDDEN = 512
"""Below this hidden size a forward is a few microseconds of math per op: a thread pool only adds
synchronisation (measured on stories260K: 0.19 ms per decode step with 1 thread, 3-7x slower with 2
on a loaded 2-core machine), so such models run single-threaded unless DFLASH_ORT_THREADS says otherwise."""


@contextlib.contextmanager
def denormals_flushed():
    """Subnormal floats as zero (x86 FTZ/DAZ) on the calling thread for the duration of one ONNX Runtime call.

    Masked attention scores make ONNX Runtime's softmax produce subnormal intermediates (``exp`` of a score far
    below the row's maximum), and each one costs a microcode assist: at 16 rows a drafter's attention took 3x, its
    softmax 9x, the time it takes with them flushed (docs/benchmarks.md, "Subnormal floats"). A flushed value is below
    1.2e-38, so no output a decision reads changes. The thread's mode is off again afterwards (Python's default);
    ``session.set_denormal_as_zero`` does the same for ONNX Runtime's own pool threads."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _session_options(quant_mode: str, small_model: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
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
    has_plugin = bool(plugin_nodes(onnx.load(str(path), load_external_data=False)))
    if has_plugin:
        from dflash_trt.plugins.onnxruntime.ops import register

        options.register_custom_ops_library(register())
    source = to_ort_domain(onnx.load(str(path))).SerializeToString() if has_plugin else str(path)
    with denormals_flushed():  # creating a session with set_denormal_as_zero sets the calling thread's mode too
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


class OrtGraph:
    """An :class:`~dflash_trt.plugins.graph_rows.Executor` over one ``InferenceSession``, driven with numpy I/O: numpy
    arrays (or CPU tensors, shared as numpy without a copy; ONNX Runtime reads a C-contiguous float32 input in place)
    in, numpy arrays out."""

    reuses_outputs = False  # every run returns new arrays

    def __init__(self, session) -> None:
        self.session = session
        self.input_names = frozenset(i.name for i in session.get_inputs())
        self.output_names = [o.name for o in session.get_outputs()]

    def run(self, inputs: dict[str, np.ndarray | Tensor]) -> dict[str, np.ndarray]:
        feeds = {name: value.numpy() if isinstance(value, Tensor) else value for name, value in inputs.items()}
        with denormals_flushed():
            return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))


class OrtBackend(SlotCaches):
    """Target and drafter graphs over host-side slot caches, ``max_batch`` slots (the batched protocol). ``graphs``
    is what the engine's manifest declares its graphs to be (``formats/manifest.py``, :class:`GraphVariants`)."""

    name = "onnxruntime"
    device = "cpu"

    def __init__(self, target_config: TargetConfig, draft_config: DraftConfig | None, target_graph: Path,
                 draft_graph: Path | None, max_seq_len: int, quant_mode: str = "none", max_batch: int = 1, *,
                 graphs: GraphVariants, max_block_len: int | None = None,
                 draft_step_graph: Path | None = None) -> None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(f"backend 'onnxruntime' needs the onnxruntime package ({exc}). Fix: "
                                          "pip install 'dflash-trt[onnx]', or pass --backend torch.") from None
        self.target_config = target_config
        self.draft_config = draft_config
        self.graphs = graphs
        self.max_block_len = max_block_len  # the build's --block-len: a DFlash2 graph's walk is unrolled over it
        self.dtype = torch.float32
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        small = target_config.hidden_size < SMALL_MODEL_HIDDEN
        drafting = draft_graph is not None and draft_config is not None and graphs.drafter is not None
        # sized before anything is allocated: in-place graphs own K and V; graphs that return rows also gather them
        target_gathers = graphs.target == "rows"
        layouts = [CacheLayout.of(target_config, self.dtype, extra_rows=0, per_slot_buffers=4 if target_gathers else 2),
                   CacheLayout.of(draft_config, self.dtype, extra_rows=0, per_slot_buffers=4,
                                  shared_buffers=2 if graphs.drafter == "plugin" else 0) if drafting else None]
        self.kv_cache = KVCachePlan(layouts[0], layouts[1], max_batch, max_seq_len, "float32")
        require_fit(self.kv_cache)
        target_session = open_session(target_graph, quant_mode, small)
        self.target_cache = StaticKVCache(target_config.num_layers, max_batch, target_config.num_kv_heads, max_seq_len,
                                          target_config.head_dim, self.dtype, extra_rows=0, gather=target_gathers)
        self._target = (_InPlaceTarget(target_session, self.target_cache) if graphs.target == "in_place"
                        else OrtGraph(target_session))
        self._draft = self.draft_cache = None
        if drafting:
            self._draft = OrtGraph(open_session(draft_graph, quant_mode, small))
            self.draft_cache = StaticKVCache(draft_config.num_layers, max_batch, draft_config.num_kv_heads, max_seq_len,
                                             draft_config.head_dim, self.dtype, extra_rows=0, gather=True,
                                             prefix=graphs.drafter == "plugin")
        self._draft_step = None  # the one-row drafter the manifest declares (graphs.one_row_drafter)
        if drafting and graphs.one_row_drafter == "in_place" and draft_step_graph is not None:
            self._draft_step = _InPlaceDrafter(open_session(draft_step_graph, quant_mode, small), self.draft_cache)
        taps = draft_config.num_taps * target_config.hidden_size if draft_config is not None else 0
        self._rows = GraphRows(max_batch, max_seq_len, taps, torch.device("cpu"), numpy_io=True)

    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        """Shapes per row: logits ``[T_i, V]`` (``[1, V]`` with ``last_only``), taps ``[T_i, L*H]`` or None. A row's
        tokens are a list or an int64 tensor (a verify row)."""
        if isinstance(self._target, _InPlaceTarget):
            return self._target.run_rows(rows, with_taps)
        return self._rows.target(self._target, self.target_cache, rows, with_taps)

    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        """Shapes per row: draft logits ``[Bc_i - 1, V]``; afterwards each draft cache holds positions ``< start``."""
        assert self._draft is not None, "draft_batch() needs a drafter graph"
        if self.graphs.drafter == "plugin":  # checks the custom op's parity on ONNX Runtime; not a fast path
            return self._rows.draft_plugin(self._draft, self.draft_cache, rows)
        if len(rows) == 1 and self._draft_step is not None and rows[0].taps.shape[0]:
            return [self._draft_step.run_row(rows[0])]  # one row: in place, no cache rows copied or written back
        return self._rows.draft(self._draft, self.draft_cache, rows)

    def propose_batch(self, rows: list[DraftRow]) -> list[DraftProposal]:
        """A DFlash2 drafter (the manifest's ``graphs.proposals`` is ``selector``): the draft call with the candidate
        selector walked in the graph, every row at once (greedy rows and sampled ones with their uniforms)."""
        assert self._draft is not None and self.graphs.proposals == "selector", "propose_batch() needs a DFlash2 graph"
        return self._rows.propose(self._draft, self.draft_cache, rows, self.max_block_len)


class _Binding:
    """One call shape of an in-place graph, bound once: ``inputs`` and ``outputs`` are buffers bound by name (filled
    and read per call), and each layer's cache view of ``count`` slots from ``first`` is bound as both its past input
    and its present output, so the graph's attention nodes extend it in place (no copy)."""

    def __init__(self, session, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                 cache: StaticKVCache, first: int, count: int) -> None:
        self.io = session.io_binding()
        self.inputs, self.outputs = inputs, outputs
        for name, array in inputs.items():
            self._bind(self.io.bind_input, name, array)
        for name, array in outputs.items():
            self._bind(self.io.bind_output, name, array)
        self.caches = []
        for kind, views in zip(("key", "value"), cache.views(first, count)):
            for layer, view in enumerate(views):
                array = view.numpy()  # the slot cache's own memory
                self._bind(self.io.bind_input, f"{kind}_cache.{layer}", array)
                self._bind(self.io.bind_output, f"present_{kind}.{layer}", array)
                self.caches.append(array)

    @staticmethod
    def _bind(bind, name: str, array: np.ndarray) -> None:
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


class _InPlaceGraph:
    """A graph over the slot cache that its attention nodes read and extend in place, with each call shape's binding
    kept (least recently used dropped past ``KEPT_BINDINGS``)."""

    KEPT_BINDINGS = 64

    def __init__(self, session, cache: StaticKVCache) -> None:
        self.session = session
        self.cache = cache
        self.output_widths = {o.name: o.shape[-1] for o in session.get_outputs() if not o.name.startswith("present")}
        self._bindings: dict[tuple, _Binding] = {}

    def _binding(self, first: int, count: int, shape: tuple, buffers) -> _Binding:
        """The binding of ``count`` slots from ``first`` for call ``shape``; ``buffers()`` -> (inputs, outputs) makes
        a new one's buffers."""
        key = (first, count) + shape
        binding = self._bindings.pop(key, None)
        if binding is None:
            binding = _Binding(self.session, *buffers(), self.cache, first, count)
            if len(self._bindings) >= self.KEPT_BINDINGS:
                self._bindings.pop(next(iter(self._bindings)))
        self._bindings[key] = binding  # most recently used last
        return binding


class _InPlaceTarget(_InPlaceGraph):
    """The target's ``target_step.onnx`` (``builder/export_onnx.py``, :class:`StepGraph`).

    A call covers a range of slots; its rows are right-padded to the widest and the slots without a row are idle
    entries (``query_seqlens``), so decode steps, verification blocks and prompts of many requests share calls
    (:func:`plan_calls`)."""

    def binding(self, first: int, count: int, width: int) -> _Binding:
        """The binding of ``count`` slots from ``first`` for rows ``width`` wide."""
        def buffers():
            inputs = {"tokens": np.zeros((count, width), np.int64), "positions": np.zeros((count, width), np.int64),
                      "seqlens_k": np.zeros(count, np.int32), "total_length": np.zeros((), np.int32),
                      "query_seqlens": np.zeros(count, np.int32)}
            return inputs, {name: np.zeros((count, width, size), np.float32)
                            for name, size in self.output_widths.items()}

        return self._binding(first, count, (width,), buffers)

    def run_rows(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        results: list[tuple[Tensor, Tensor | None] | None] = [None] * len(rows)
        for row in rows:
            assert row.start <= self.cache.lengths[row.slot], "target cache gap"
            assert row.start + len(row.tokens) <= self.cache.max_len, "target cache overflow"
        spans = [(row.slot, row.start, len(row.tokens)) for row in rows]
        for group in plan_calls(spans, self.cache.max_len):
            self._run([rows[i] for i in group], with_taps, results, group)
        return results

    def _run(self, rows: list[TargetRow], with_taps: bool, results: list, indices: list[int]) -> None:
        """One call over the slots from ``rows[0]``'s to ``rows[-1]``'s (rows sorted by slot); a slot between them
        without a row is an idle entry (``query_seqlens`` 0: nothing written, its outputs ignored)."""
        # padding rows are never written; their position 0 keeps the rotation inside its table
        tokens, positions, layout = pack_target(rows, 0)
        first = rows[0].slot
        entries = [row.slot - first for row in rows]  # each row's entry in the call
        width, count = tokens.shape[1], entries[-1] + 1
        inputs = (bound := self.binding(first, count, width)).inputs
        widths, starts = np.array(layout.lengths), np.array(layout.starts)
        if count > len(rows):  # (plan_calls) an idle entry: one unread row, none new
            inputs["seqlens_k"][:] = 0
            inputs["query_seqlens"][:] = 0
        at = entries if count > len(rows) else slice(None)
        inputs["tokens"][at] = tokens
        inputs["positions"][at] = positions
        inputs["seqlens_k"][at] = starts + widths - 1
        inputs["query_seqlens"][at] = widths
        inputs["total_length"][...] = (starts + widths).max()
        with denormals_flushed():
            self.session.run_with_iobinding(bound.io)
        logits, taps = bound.outputs["logits"], bound.outputs.get("taps")
        for entry, index, row in zip(entries, indices, rows):
            count = len(row.tokens)
            self.cache.lengths[row.slot] = row.start + count
            kept = slice(count - 1, count) if row.last_only else slice(0, count)
            results[index] = (torch.from_numpy(logits[entry, kept].copy()),  # the buffers are reused
                              torch.from_numpy(taps[entry, :count].copy()) if with_taps and taps is not None
                              else None)


class _InPlaceDrafter(_InPlaceGraph):
    """The drafter's ``draft_step.onnx`` (``builder/export_onnx.py``, :class:`DraftStepGraph`) for a draft call of one
    row: it writes the new context rows (and the block's, which the next call overwrites) after the committed ones,
    in place, and the cache is committed up to the anchor. ONNX Runtime's kernel takes several new rows after a past
    for one row only, so calls of several rows go to ``draft.onnx``."""

    def __init__(self, session, cache: StaticKVCache) -> None:
        super().__init__(session, cache)
        self.taps_width = next(i.shape[-1] for i in session.get_inputs() if i.name == "taps")
        self._taps = np.zeros((1, 0, self.taps_width), np.float32)  # the context inputs of every binding, grown as
        self._context_positions = np.zeros((1, 0), np.int64)  # needed and bound per call (see ``run_row``)

    def run_row(self, row: DraftRow) -> Tensor:
        """Shapes: draft logits ``[Bc - 1, V]``. A binding per slot and block width; the context inputs, whose length
        changes from call to call (the rows the last cycle committed, or a prompt), are bound per call as prefixes of
        buffers shared by all of them. Bound per context length too, a drafting slot's bindings outnumbered
        ``KEPT_BINDINGS`` (up to 16 context lengths for each block width, and each prompt's), and an ONNX Runtime
        engine at c=1 made ~450 of them again in one bench command, each 0.25 ms of a 1.3 ms cycle: the first steps at a
        block width drafted now and then ran ~40% slower than its steady ones, and the width was priced ~30% above its
        cost (docs/adaptive-notebook.md, "Drafter bindings per block width")."""
        context, width = row.taps.shape[0], len(row.block)
        past = row.start - context
        assert context >= 1 and past <= self.cache.lengths[row.slot], "draft cache gap"
        assert row.start + width <= self.cache.max_len, "draft cache overflow"

        def buffers():
            inputs = {"block": np.zeros((1, width), np.int64), "block_positions": np.zeros((1, width), np.int64),
                      "seqlens_k": np.zeros(1, np.int32), "total_length": np.zeros((), np.int32)}
            return inputs, {"draft_logits": np.zeros((1, width - 1, self.output_widths["draft_logits"]), np.float32)}

        bound = self._binding(row.slot, 1, (width,), buffers)
        if context > self._taps.shape[1]:  # grown (a longer prompt): every call binds them again anyway
            self._taps = np.zeros((1, max(context, 2 * self._taps.shape[1]), self.taps_width), np.float32)
            self._context_positions = np.zeros((1, self._taps.shape[1]), np.int64)
        taps, positions = self._taps[:, :context], self._context_positions[:, :context]  # contiguous prefixes
        taps[0] = row.taps.numpy()
        positions[0] = np.arange(past, row.start)
        _Binding._bind(bound.io.bind_input, "taps", taps)
        _Binding._bind(bound.io.bind_input, "context_positions", positions)
        inputs = bound.inputs
        inputs["block"][0] = row.block
        inputs["block_positions"][0] = np.arange(row.start, row.start + width)
        inputs["seqlens_k"][0] = row.start + width - 1
        inputs["total_length"][...] = row.start + width
        with denormals_flushed():
            self.session.run_with_iobinding(bound.io)
        self.cache.lengths[row.slot] = row.start
        return torch.from_numpy(bound.outputs["draft_logits"][0].copy())  # the buffers are reused


MAX_PADDING = 0.5
"""Largest share of a call's padded rows that may be padding (right-padding costs the same as real rows)."""


def plan_calls(spans: list[tuple[int, int, int]], capacity: int) -> list[list[int]]:
    """Which rows share a ``target_step.onnx`` call: indices into ``spans`` (``(slot, start, width)`` per row), sorted
    by slot. A call covers the slots from its first row's to its last row's, right-padded to its widest row; a slot in
    between without a row is an idle entry. One-token rows and wider rows go to separate calls; a row joins a call
    while at most ``MAX_PADDING`` of the call's rows would be padding (right padding and idle entries: they cost
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
                joins = (padded * entries * (1 - MAX_PADDING) <= useful + width
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
