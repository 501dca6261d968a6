"""Tensors one at a time: where a build reads them from and how it writes a safetensors file without holding it.

A build that rewrites weights (quantization, a format conversion) needs each tensor only while it converts it.
``TensorSource`` names the tensors of a checkpoint with their dtype and shape (from the safetensors headers) and
reads one on demand; ``SafetensorsWriter`` takes the list of (name, dtype, shape) up front, writes the header, then
appends each tensor's bytes as it is produced, so memory holds one tensor (plus whatever the caller keeps), never
the file. The file is a plain safetensors file: any reader (``safetensors``, transformers, TensorRT-LLM) loads it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from dflash_trt.formats.safe_files import (SAFETENSORS_DTYPES, TensorEntry, check_complete, read_headers,
                                           read_tensor, safetensors_files)

_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
_ALIGN = 8  # the header is padded so every tensor starts 8-byte aligned (what the safetensors writer does)


class TensorSource:
    """The tensors of a checkpoint by name: ``specs`` (dtype, shape) from headers, ``get`` reads one tensor."""

    def __init__(self, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], reader) -> None:
        self.specs = dict(specs)
        self._reader = reader

    @classmethod
    def from_folder(cls, folder: Path) -> TensorSource:
        """An HF-style folder (``model.safetensors`` or shards named by its index): headers only until ``get``."""
        entries: dict[str, TensorEntry] = read_headers(safetensors_files(folder))
        check_complete(entries)
        return cls({name: (e.dtype, e.shape) for name, e in entries.items()}, lambda name: read_tensor(entries[name]))

    @classmethod
    def from_state(cls, state: Mapping[str, Tensor]) -> TensorSource:
        """Tensors already in memory (a llama2.c checkpoint, a model's ``state_dict``)."""
        return cls({name: (t.dtype, tuple(t.shape)) for name, t in state.items()}, lambda name: state[name])

    def get(self, name: str) -> Tensor:
        return self._reader(name)


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor. ``plan`` lists every (name, dtype, shape) in the order the tensors
    will be written; :meth:`write` checks each against it; :meth:`close` refuses a file left incomplete.

    Usage::

        with SafetensorsWriter(path, plan, metadata={"format": "pt"}) as out:
            for name, tensor in produce():
                out.write(name, tensor)
    """

    def __init__(self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self._plan = list(plan)
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, dtype, shape in self._plan:
            if dtype not in _CODES:
                raise ValueError(f"{path}: tensor `{name}` has dtype {dtype}; "
                                 f"safetensors stores {sorted(_CODES, key=str)}")
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % _ALIGN)
        self._handle = self.path.open("wb")
        self._handle.write(len(raw).to_bytes(8, "little") + raw)
        self._next = 0

    def write(self, name: str, tensor: Tensor) -> None:
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: tensor `{name}` is one more than the {len(self._plan)} planned")
        want_name, dtype, shape = self._plan[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor #{self._next} is `{name}` {tensor.dtype} {tuple(tensor.shape)}; "
                             f"the plan says `{want_name}` {dtype} {tuple(shape)}")
        data = tensor.detach().contiguous().cpu()
        if data.numel():
            self._handle.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        self._handle.close()
        if self._next != len(self._plan):
            os.unlink(self.path)
            raise ValueError(f"{self.path}: {self._next} of {len(self._plan)} planned tensors written; file removed")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self._handle.close()
            self.path.unlink(missing_ok=True)
            return
        self.close()
