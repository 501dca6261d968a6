"""ONNX exports cached for the test session: a graph already exported from the same request is copied, not traced again.

An engine build traces its graphs with the dynamo exporter (10-20 s per graph on a CPU), and many builder, plugin and
runtime tests build engines whose graphs are the same: the same hollow modules over the same limits, reading the same
stored tensors (``weights``: file, offset, dtype and shape of each). A graph is a function of that request alone, so
the file written the first time is the file every later export of the request writes. Installed by ``conftest.py``.

The key holds everything the graph is made from: the export function, each module's type, config, parameters and
buffers, the other arguments, the file name and the module constants the exporter reads. Exports without stored
weights (the weights written into the graph) are never cached. Each export runs under its own RNG
state (the example inputs draw from it), so the global RNG a test sees does not depend on which graphs were cached.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
from pathlib import Path

import torch

EXPORTERS = ("export_target", "export_step_target", "export_draft", "export_step_draft")
CONSTANTS = ("OPSET", "OPSET_ONNXRUNTIME", "EXTERNAL_DATA_BYTES", "FOLD_LIMIT_BYTES")


def module_key(module: torch.nn.Module) -> tuple:
    """A module as the exporter sees it: type, config, parameter shapes and dtypes, buffer values."""
    config = getattr(module, "config", None)
    parameters = tuple((name, str(p.dtype), tuple(p.shape), values(p)) for name, p in module.named_parameters())
    buffers = tuple((name, str(b.dtype), tuple(b.shape), values(b)) for name, b in module.named_buffers())
    return (type(module).__qualname__, config.model_dump_json() if config is not None else None, parameters, buffers)


def values(tensor: torch.Tensor) -> str:
    """A digest of the values; "hollow" for ``export_onnx.hollow``'s zeros (one element, zero strides)."""
    if tensor.dim() and not any(tensor.stride()):
        return "hollow"
    raw = tensor.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def argument_key(value) -> object:
    return module_key(value) if isinstance(value, torch.nn.Module) else value


class ExportCache:
    """Wraps the exporters of ``dflash_trt.builder.export_onnx``; graphs are kept in ``folder``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.graphs: dict[tuple, Path] = {}

    def install(self, monkeypatch) -> None:
        from dflash_trt.builder import export_onnx

        for name in EXPORTERS:
            monkeypatch.setattr(export_onnx, name, self.cached(name, getattr(export_onnx, name), export_onnx))

    def cached(self, name: str, export, export_onnx):
        signature = inspect.signature(export)

        def run(*args, **kwargs):
            request = signature.bind(*args, **kwargs)
            request.apply_defaults()
            fields = dict(request.arguments)
            path, weights = Path(fields.pop("path")), fields.pop("weights")
            with torch.random.fork_rng(devices=[]):
                if not weights:
                    return export(*args, **kwargs)
                key = (name, path.name, tuple((k, argument_key(v)) for k, v in fields.items()),
                       tuple(sorted(weights.items())), tuple(getattr(export_onnx, c) for c in CONSTANTS))
                if key in self.graphs:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(self.graphs[key], path)
                    return path
                written = export(*args, **kwargs)
                kept = self.folder / f"{len(self.graphs)}-{path.name}"
                shutil.copyfile(written, kept)
                self.graphs[key] = kept
                return written

        return run
