"""The ``onnxruntime`` backend: the engine's ONNX graphs on ONNX Runtime (CPU by default).

Each network keeps one static float32 KV cache on the host, ``[layers, 1, nkv, max_seq_len, d]``,
allocated at setup (style R5). A call feeds the live prefix ``cache[..., :P, :]`` to the graph and
writes back only the rows the graph returns (``builder/export_onnx.py`` describes the I/O), so
cropping is bookkeeping, exactly as in ``model/kv_cache.py``. The loop, verification and stats
are the shared ones in ``runtime/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import BackendUnavailableError

THREADS_ENV = "DFLASH_ORT_THREADS"
"""Intra-op threads of every session (unset: 1 for small models, else ONNX Runtime's default)."""

SMALL_MODEL_HIDDEN = 512
"""Below this hidden size a forward is a few microseconds of math per op: a thread pool only adds
synchronisation (measured on stories260K: 0.19 ms per decode step with 1 thread, 3-7x slower with 2
on a loaded 2-core machine), so such models run single-threaded unless DFLASH_ORT_THREADS says otherwise."""


def _session_options(quant_mode: str, small_model: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    # FP8 Q/DQ graphs are miscompiled by ORT's extended optimisations (environment.md §5)
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
    """Target and drafter graphs with host-side static caches (batch row 0)."""

    name = "onnxruntime"

    def __init__(self, target_config: TargetConfig, draft_config: DraftConfig | None, target_graph: Path,
                 draft_graph: Path | None, max_seq_len: int, quant_mode: str = "none") -> None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(f"backend 'onnxruntime' needs the onnxruntime package ({exc}). Fix: "
                                          "pip install 'dflash-trt[onnx]', or pass --backend torch.") from None
        self.target_config = target_config
        self.draft_config = draft_config
        self.tap_ids = draft_config.target_layer_ids if draft_config is not None else ()
        small = target_config.hidden_size < SMALL_MODEL_HIDDEN
        self._target = open_session(target_graph, quant_mode, small)
        self._target_outputs = [o.name for o in self._target.get_outputs()]
        self._draft = open_session(draft_graph, quant_mode, small) if draft_graph is not None else None
        t = target_config
        self._target_keys = np.zeros((t.num_layers, 1, t.num_kv_heads, max_seq_len, t.head_dim), np.float32)
        self._target_values = np.zeros_like(self._target_keys)
        self._target_length = 0
        if draft_config is not None:
            d = draft_config
            self._draft_keys = np.zeros((d.num_layers, 1, d.num_kv_heads, max_seq_len, d.head_dim), np.float32)
            self._draft_values = np.zeros_like(self._draft_keys)
        self._draft_length = 0
        self.max_seq_len = max_seq_len

    def reset(self) -> None:
        self._target_length = 0
        self._draft_length = 0

    def target(self, tokens: Tensor, start: int, with_taps: bool, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        length = tokens.shape[1]
        assert start <= self._target_length and start + length <= self.max_seq_len, "target cache gap or overflow"
        feeds = {"tokens": tokens.numpy().astype(np.int64, copy=False),
                 "past_keys": np.ascontiguousarray(self._target_keys[:, :, :, :start]),
                 "past_values": np.ascontiguousarray(self._target_values[:, :, :, :start])}
        outputs = dict(zip(self._target_outputs, self._target.run(None, feeds)))
        self._target_keys[:, :, :, start:start + length] = outputs["new_keys"]
        self._target_values[:, :, :, start:start + length] = outputs["new_values"]
        self._target_length = start + length
        logits = outputs["logits"][0, -1:] if last_only else outputs["logits"][0]
        taps = torch.from_numpy(outputs["taps"][0]) if with_taps and "taps" in outputs else None
        return torch.from_numpy(logits), taps

    def draft(self, block: Tensor, taps: Tensor, start: int) -> Tensor:
        assert self._draft is not None, "draft() needs a drafter graph"
        context = taps.shape[0]
        past = start - context
        assert past <= self._draft_length and start + block.shape[1] <= self.max_seq_len, "draft cache gap/overflow"
        feeds = {"block": block.numpy().astype(np.int64, copy=False),
                 "taps": np.ascontiguousarray(taps.numpy(), dtype=np.float32)[None],
                 "past_keys": np.ascontiguousarray(self._draft_keys[:, :, :, :past]),
                 "past_values": np.ascontiguousarray(self._draft_values[:, :, :, :past])}
        logits, context_keys, context_values = self._draft.run(None, feeds)
        self._draft_keys[:, :, :, past:start] = context_keys
        self._draft_values[:, :, :, past:start] = context_values
        self._draft_length = start  # the cache holds exactly the context rows < start
        return torch.from_numpy(logits[0])

    def crop_target(self, length: int) -> None:
        self._target_length = min(self._target_length, length)
