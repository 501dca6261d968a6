"""The ``tensorrt`` backend: the engine's TensorRT plans, device buffers and one CUDA stream (GPU only).

Same I/O as the ONNX graphs (``builder/export_onnx.py``): each network keeps a static device KV cache
``[layers, 1, nkv, max_seq_len, d]``; a call copies the live prefix into a preallocated contiguous
staging buffer, binds every tensor address, runs ``execute_async_v3`` on the session's stream and
writes the returned rows back. All buffers are allocated at setup from the profile maxima (style R5).
Logits come back to the host because the shared loop in ``runtime/`` runs on CPU tensors.

Order of operations is a safety rule (environment.md §6.3): the GPU is checked *before* ``tensorrt`` is
imported or any runtime object exists, because deserialising without a GPU segfaults.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from dflash_trt.errors import BackendUnavailableError, EngineFormatError


class _Plan:
    """One deserialised plan with its execution context and output buffers (allocated at max shapes)."""

    def __init__(self, runtime, path: Path, outputs: dict[str, tuple[int, ...]], device: torch.device) -> None:
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise EngineFormatError(f"{path}: TensorRT could not deserialise the plan (see the TensorRT log). Fix: "
                                    "rebuild the engine on this machine with `dflash-trt build --backend tensorrt`.")
        self.context = self.engine.create_execution_context()
        self.outputs = {name: torch.empty(shape, dtype=torch.float32, device=device) for name, shape in outputs.items()}

    def run(self, inputs: dict[str, Tensor], stream: torch.cuda.Stream) -> dict[str, Tensor]:
        for name, tensor in inputs.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        results = {}
        for name, buffer in self.outputs.items():
            shape = tuple(self.context.get_tensor_shape(name))
            view = buffer.view(-1)[:int(torch.Size(shape).numel())].view(shape)
            self.context.set_tensor_address(name, view.data_ptr())
            results[name] = view
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise BackendUnavailableError("TensorRT execute_async_v3 failed (see the TensorRT log).")
        return results


class TensorRTBackend:
    """Target and drafter plans with device caches (batch row 0)."""

    name = "tensorrt"

    def __init__(self, pair, engine, max_seq_len: int) -> None:
        from dflash_trt.plugins.tensorrt.device import gpu_info, needs_message

        if gpu_info() is None:  # before any TensorRT object: a GPU-less runtime segfaults on deserialise
            raise BackendUnavailableError(needs_message("the tensorrt backend") + ". Fix: use --backend onnxruntime.")
        import tensorrt as trt

        self.device = torch.device("cuda", 0)
        self.stream = torch.cuda.Stream(self.device)
        self.target_config = pair.target.config
        self.draft_config = pair.draft.config if pair.draft is not None else None
        manifest = engine.manifest
        self._logger = trt.Logger(trt.Logger.WARNING)
        if manifest.tensorrt.plugin_library:
            library = engine.folder / manifest.tensorrt.plugin_library
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
            trt.get_plugin_registry().load_library(str(library))
        self._runtime = trt.Runtime(self._logger)
        t, limits = self.target_config, manifest.build
        width = (self.draft_config.num_taps * t.hidden_size) if self.draft_config else 0
        batch = limits.max_batch_size
        target_outputs = {"logits": (batch, max_seq_len, t.vocab_size),
                          "new_keys": (t.num_layers, batch, t.num_kv_heads, max_seq_len, t.head_dim),
                          "new_values": (t.num_layers, batch, t.num_kv_heads, max_seq_len, t.head_dim)}
        if width:
            target_outputs["taps"] = (batch, max_seq_len, width)
        self._target = _Plan(self._runtime, engine.path_of("target_plan"), target_outputs, self.device)
        self._target_cache = self._cache(t.num_layers, t.num_kv_heads, t.head_dim, max_seq_len)
        self._draft = None
        if self.draft_config is not None:
            d = self.draft_config
            self._draft = _Plan(self._runtime, engine.path_of("draft_plan"), {
                "draft_logits": (batch, limits.block_len, t.vocab_size),
                "context_keys": (d.num_layers, batch, d.num_kv_heads, max_seq_len, d.head_dim),
                "context_values": (d.num_layers, batch, d.num_kv_heads, max_seq_len, d.head_dim)}, self.device)
            self._draft_cache = self._cache(d.num_layers, d.num_kv_heads, d.head_dim, max_seq_len)
        self._tokens = torch.zeros(max_seq_len, dtype=torch.int64, device=self.device)
        self._taps = torch.zeros(max_seq_len * max(width, 1), dtype=torch.float32, device=self.device)
        self.max_seq_len = max_seq_len

    def _cache(self, layers: int, heads: int, dim: int, length: int) -> dict[str, Tensor]:
        shape = (layers, 1, heads, length, dim)
        return {"keys": torch.zeros(shape, device=self.device), "values": torch.zeros(shape, device=self.device),
                "past_keys": torch.zeros(shape, device=self.device).view(-1),
                "past_values": torch.zeros(shape, device=self.device).view(-1)}

    @staticmethod
    def _prefix(cache: dict[str, Tensor], name: str, rows: int) -> Tensor:
        """Copy cache rows ``< rows`` into the contiguous staging buffer and return it as ``[N, 1, nkv, rows, d]``."""
        source = cache["keys" if name == "past_keys" else "values"][:, :, :, :rows]
        staged = cache[name][:source.numel()].view(source.shape)
        staged.copy_(source)
        return staged

    def reset(self) -> None:
        """Caches are overwritten from row 0 by the next prefill; nothing to clear."""

    @torch.inference_mode()
    def target(self, tokens: Tensor, start: int, with_taps: bool, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        length = tokens.shape[1]
        with torch.cuda.stream(self.stream):
            device_tokens = self._tokens[:length].view(1, length)
            device_tokens.copy_(tokens, non_blocking=True)
            cache = self._target_cache
            out = self._target.run({"tokens": device_tokens, "past_keys": self._prefix(cache, "past_keys", start),
                                    "past_values": self._prefix(cache, "past_values", start)}, self.stream)
            cache["keys"][:, :, :, start:start + length] = out["new_keys"]
            cache["values"][:, :, :, start:start + length] = out["new_values"]
            logits = out["logits"][0, -1:] if last_only else out["logits"][0]
            logits, taps = logits.cpu(), (out["taps"][0].cpu() if with_taps and "taps" in out else None)
        self.stream.synchronize()
        return logits, taps

    @torch.inference_mode()
    def draft(self, block: Tensor, taps: Tensor, start: int) -> Tensor:
        context = taps.shape[0]
        past = start - context
        with torch.cuda.stream(self.stream):
            device_block = self._tokens[:block.shape[1]].view(1, -1)
            device_block.copy_(block, non_blocking=True)
            device_taps = self._taps[:taps.numel()].view(1, *taps.shape)
            device_taps.copy_(taps, non_blocking=True)
            cache = self._draft_cache
            out = self._draft.run({"block": device_block, "taps": device_taps,
                                   "past_keys": self._prefix(cache, "past_keys", past),
                                   "past_values": self._prefix(cache, "past_values", past)}, self.stream)
            cache["keys"][:, :, :, past:start] = out["context_keys"]
            cache["values"][:, :, :, past:start] = out["context_values"]
            logits = out["draft_logits"][0].cpu()
        self.stream.synchronize()
        return logits

    def crop_target(self, length: int) -> None:
        """Bookkeeping only: the next write at ``length`` overwrites rejected rows."""
