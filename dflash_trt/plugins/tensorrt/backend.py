"""The ``tensorrt`` backend: the engine's TensorRT plans over device-resident slot caches (GPU only).

The plans are built from the same batched ONNX graphs as the ``onnxruntime`` backend (``builder/export_onnx.py``
describes their I/O). Each network keeps the one slot cache (``model/kv_cache.py``: layer-major ``[layers,
max_batch, nkv, S, d]``, one slot per request) on the GPU, allocated at setup with every input and gather buffer
(docs/style.md R5). A forward binds the cache rows of its requests in place (per layer, a contiguous run of slots
is a view; other sets are gathered into a preallocated buffer), runs ``execute_async_v3`` on the current CUDA
stream and writes back only the K/V rows the plan returns: ``plugins/graph_rows.py``, shared with the
``onnxruntime`` backend. Every drafting row shares one draft call. Logits, taps and drafts stay on the GPU
(``device``): the backend makes no device-to-host copy, so the runtime's acceptance readback is the step's one host
transfer. A drafter plan built from ``draft_plugin.onnx`` (``DFlashBlockAttention`` nodes, prefix I/O; the folder's
manifest says which) runs row by row, since its rows must share one context length.

Order of operations is a safety rule: the GPU is checked *before* ``tensorrt`` is imported or any runtime
object exists, because deserialising without a GPU crashes the process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from dflash_trt.errors import BackendUnavailableError, EngineFormatError
from dflash_trt.model.kv_cache import CacheLayout, KVCachePlan, SlotCaches, StaticKVCache
from dflash_trt.plugins.graph_rows import Executor, GraphRows
from dflash_trt.plugins.interface import DraftProposal, DraftRow, TargetRow
from dflash_trt.model.memory import require_fit


class TensorRTPlan:
    """One deserialised plan, its execution context and output buffers at the profile's maximum shapes (an
    ``Executor``: its outputs are views of those buffers)."""

    reuses_outputs = True

    def __init__(self, runtime, path: Path, max_shapes: dict[str, tuple[int, ...]], device: torch.device,
                 dtypes: dict[str, torch.dtype] | None = None) -> None:
        """``dtypes``: outputs that are not float32 (a DFlash2 drafter's token ids are int64)."""
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
        self.outputs = {n: torch.empty(max_shapes[n], dtype=(dtypes or {}).get(n, torch.float32), device=device)
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


class TensorRTBackend(SlotCaches):
    """Target and drafter plans over device slot caches, ``max_batch`` slots (the batched protocol).

    ``plans`` (target, drafter) replaces the engine's TensorRT plans with other executors of the same I/O on
    ``device`` and ``plugin_drafter`` says whether the drafter's is the plugin-node graph; without them the plans are
    deserialised from ``engine`` on ``cuda:0`` and its manifest says which drafter graph the plan was built from."""

    name = "tensorrt"

    def __init__(self, pair, engine, max_seq_len: int, max_batch: int = 1,
                 plans: tuple[Executor, Executor | None] | None = None, device: str = "cuda:0",
                 plugin_drafter: bool = False) -> None:
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
        self.max_block_len = None  # the build's --block-len (a DFlash2 plan's walk is unrolled over it)
        if plans is None:
            plans, plugin_drafter = self._load_plans(engine)
            self.max_block_len = engine.manifest.build.block_len
        self._target, self._draft = plans
        self.plugin_drafter = plugin_drafter
        device_ = torch.device(self.device)
        t, d = self.target_config, self.draft_config if self._draft is not None else None
        # the slot caches: K, V and their gather buffers per slot, plus the plugin graph's prefix K and V (one slot's)
        layouts = [None if config is None else CacheLayout.of(config, self.dtype, extra_rows=0, per_slot_buffers=4,
                                                              shared_buffers=2 if prefix else 0)
                   for config, prefix in ((t, False), (d, plugin_drafter))]
        dtype = str(self.dtype).removeprefix("torch.")
        self.kv_cache = KVCachePlan(layouts[0], layouts[1], max_batch, max_seq_len, dtype, self.device)
        require_fit(self.kv_cache)  # before allocating, with the numbers (docs/style.md R5)
        self.target_cache = StaticKVCache(t.num_layers, max_batch, t.num_kv_heads, max_seq_len, t.head_dim,
                                           self.dtype, device_, extra_rows=0, gather=True)
        self.draft_cache = None
        if d is not None:
            self.draft_cache = StaticKVCache(d.num_layers, max_batch, d.num_kv_heads, max_seq_len, d.head_dim,
                                              self.dtype, device_, extra_rows=0, gather=True, prefix=plugin_drafter)
        # inputs, assembled on the host each step and copied in (one small host-to-device copy per input)
        self._rows = GraphRows(max_batch, max_seq_len, self._tap_width(), device_)

    def _load_plans(self, engine) -> tuple[tuple[Executor, Executor | None], bool]:
        """The plans and whether the drafter's was built from the plugin-node graph (the manifest says)."""
        import tensorrt as trt

        from dflash_trt.formats.manifest import graph_variants

        manifest = engine.manifest
        graph_variants(manifest, engine.folder)  # refuses graphs of an older format before anything is loaded
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
            return (target, None), False
        context = (batch, d.num_layers, d.num_kv_heads, seq, d.head_dim)
        selector = manifest.graphs.proposals == "selector"  # a DFlash2 drafter: the selector walk in the plan
        proposals = ({"draft_tokens": (batch, block), "candidates": (batch, block, d.selector_top_k),
                      "proposal_probs": (batch, block, d.selector_top_k)} if selector
                     else {"draft_logits": (batch, block, t.vocab_size)})
        draft = TensorRTPlan(self._runtime, engine.path_of("draft_plan"),
                             proposals | {"context_keys": context, "context_values": context},
                             torch.device(self.device), {"draft_tokens": torch.int64, "candidates": torch.int64})
        # build_trt builds the drafter's plan from draft_plugin.onnx exactly when it built the plugin library
        return (target, draft), manifest.tensorrt.plugin_library is not None

    def _tap_width(self) -> int:
        d = self.draft_config
        return d.num_taps * self.target_config.hidden_size if d is not None else 0

    @torch.inference_mode()
    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        """Shapes per row: logits ``[T_i, V]`` (``[1, V]`` with ``last_only``), taps ``[T_i, L*H]`` or None;
        on ``device``. A row's tokens may be a tensor on ``device`` (a verify row): they are packed there, not read
        back."""
        return self._rows.target(self._target, self.target_cache, rows, with_taps)

    @torch.inference_mode()
    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        """Shapes per row: draft logits ``[Bc_i - 1, V]`` on ``device``; afterwards each draft cache holds
        positions ``< start``."""
        assert self._draft is not None and self.draft_cache is not None, "draft_batch() needs a drafter plan"
        if self.plugin_drafter:
            return self._rows.draft_plugin(self._draft, self.draft_cache, rows)
        return self._rows.draft(self._draft, self.draft_cache, rows)

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[DraftProposal]:
        """A DFlash2 drafter: the draft call with the candidate selector walked in the plan (built from the standard
        graph: a DFlash2 drafter has no plugin-node variant), every row at once; proposals on ``device``."""
        assert self._draft is not None and self.draft_cache is not None, "propose_batch() needs a drafter plan"
        return self._rows.propose(self._draft, self.draft_cache, rows, self.max_block_len)
