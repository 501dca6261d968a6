"""Backend registry: name -> factory. Unknown names raise an error listing the known ones (style R9).

A factory is called as ``factory(pair, max_seq_len, engine)``: ``engine`` is the verified
``runtime.engine_loader.LoadedEngine`` when the session comes from an engine folder, else None.
Backends that execute built artefacts (onnxruntime, tensorrt) need one; the torch backend runs
the pair's modules and ignores it. ``auto`` resolves to the fastest backend that can run here
(``runtime.engine_loader.resolve_backend`` for engine folders; ``torch`` for checkpoints).
"""

from __future__ import annotations

from typing import Callable

from dflash_trt.errors import BackendUnavailableError


def _torch_backend(pair, max_seq_len, engine=None, max_batch=1):
    from dflash_trt.plugins.torch_ref.backend import TorchBackend

    return TorchBackend(pair, max_seq_len, max_batch)


def _onnxruntime_backend(pair, max_seq_len, engine=None, max_batch=1):
    if engine is None:
        raise BackendUnavailableError("backend 'onnxruntime' runs the ONNX graphs of an engine folder; got "
                                      "checkpoints. Fix: `dflash-trt build --backend onnxruntime --out engines/NAME`, "
                                      "then Session.load('engines/NAME') / `dflash-trt run --engine engines/NAME`.")
    from dflash_trt.plugins.onnxruntime.backend import OrtBackend

    return OrtBackend(pair.target.config, pair.draft.config if pair.draft is not None else None,
                      engine.target_graph, engine.draft_graph if pair.draft is not None else None, max_seq_len,
                      engine.manifest.quantization.mode)


def _tensorrt_backend(pair, max_seq_len, engine=None, max_batch=1):
    if engine is None:
        raise BackendUnavailableError("backend 'tensorrt' runs the TensorRT plans of an engine folder; got "
                                      "checkpoints. Fix: `dflash-trt build --backend tensorrt --out engines/NAME` on a "
                                      "GPU machine, then Session.load('engines/NAME').")
    from dflash_trt.plugins.tensorrt.backend import TensorRTBackend

    return TensorRTBackend(pair, engine, max_seq_len)


_FACTORIES: dict[str, Callable] = {"torch": _torch_backend, "onnxruntime": _onnxruntime_backend,
                                   "tensorrt": _tensorrt_backend}


def register_backend(name: str, factory: Callable) -> None:
    _FACTORIES[name] = factory


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def create_backend(name: str, pair, max_seq_len: int, engine=None, max_batch: int = 1):
    """Instantiate backend ``name``; ``auto`` without an engine folder is ``torch``."""
    if name == "auto":
        name = "torch"
    if name not in _FACTORIES:
        raise BackendUnavailableError(f"backend is {name!r}; expected one of {available_backends()} or 'auto'. "
                                      "Fix: pass --backend torch.")
    return _FACTORIES[name](pair, max_seq_len, engine, max_batch)
