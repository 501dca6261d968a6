"""Safe tensor-file access: safetensors only, never a pickle, never a file outside the checkpoint.

torch ``.bin``/``.pt`` files are pickles that can run arbitrary code when loaded; we refuse
them by content (zip or pickle magic), not by name, and point at the safetensors conversion.
Shards named by a ``model.safetensors.index.json`` must lie inside its folder (no absolute
paths, ``..`` or symbolic links pointing out).

Weights stream: :func:`read_headers` parses the JSON headers only (``inspect`` and every key/shape check run
on it), and :func:`read_tensor` reads one tensor's bytes straight from the file into a tensor of its stored
dtype, converting it to the dtype asked for, so a loader holds the model plus one tensor in flight, never a
second copy of the checkpoint and never a mapping of whole files (whose touched pages count as resident).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.errors import CheckpointFormatError

_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
_ZIP_MAGIC = b"PK\x03\x04"


def is_torch_pickle(path: Path) -> bool:
    """True when the file starts like ``torch.save`` output (a zip archive or a raw pickle)."""
    with path.open("rb") as handle:
        head = handle.read(4)
    return head.startswith(_ZIP_MAGIC) or head[:2] in _PICKLE_MAGIC


def refuse_pickle(path: Path) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path}: is a torch pickle (.bin/.pt); expected safetensors. Pickles can execute code when loaded, so "
        "dflash_trt never opens them. Fix: convert it where you trust it, e.g. "
        "`python -c \"import torch, safetensors.torch as s; s.save_file(torch.load('IN', weights_only=True), "
        "'model.safetensors')\"`."
    )


def read_json(path: Path, what: str) -> dict:
    """Parse a JSON object file, naming the file in every failure."""
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: {what} not found; expected a JSON file there. Fix: point at the "
                                    "checkpoint folder that contains it.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"{path}: is not valid JSON ({exc}); expected a {what}. Fix: re-export the "
                                    "checkpoint.") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: top level is {type(data).__name__}; expected a JSON object. Fix: "
                                    "re-export the checkpoint.")
    return data


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF-style folder: ``model.safetensors`` or the shards named by its index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFormatError(f"{index}: field `weight_map` is missing or empty; expected a map from "
                                        "tensor name to shard file. Fix: re-export the checkpoint.")
        names = set(weight_map.values())
        outside = sorted(str(name) for name in names if not isinstance(name, str)
                         or not (folder / name).resolve().is_relative_to(folder.resolve()))
        if outside:
            raise CheckpointFormatError(f"{index}: names shard(s) {outside[:3]} outside {folder}; expected shard "
                                        "files inside the checkpoint folder. Fix: re-export the checkpoint, or copy "
                                        "it with links dereferenced (cp -rL).")
        shards = sorted(folder / name for name in names)
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointFormatError(f"{index}: names shards {missing} that are not in {folder}. Fix: copy "
                                        "every shard listed in the index.")
        return shards
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise refuse_pickle(pickles[0])
    raise CheckpointFormatError(f"{folder}: no `model.safetensors` or `model.safetensors.index.json`; expected "
                                "safetensors weights. Fix: save the model with `save_pretrained(..., "
                                "safe_serialization=True)`.")


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""The safetensors dtype codes a tensor may carry, as torch dtypes."""
_HEADER_LIMIT = 100 * 1024 * 1024  # the safetensors format's own bound on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, from its header: where its bytes lie (``offset`` is absolute)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _unreadable(file: Path, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file}: cannot be read as safetensors ({why}). Fix: re-download or re-export "
                                 "the file.")


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file declares (name, dtype, shape, byte range), from its header alone: no tensor
    data is read. A torch pickle is refused by content, whatever its name."""
    if is_torch_pickle(file):
        raise refuse_pickle(file)
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise _unreadable(file, f"{len(prefix)} bytes; a safetensors file starts with an 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > _HEADER_LIMIT:
            raise _unreadable(file, f"header length {length} bytes; expected at most {_HEADER_LIMIT}")
        raw = handle.read(length)
    if len(raw) < length:
        raise _unreadable(file, f"header promises {length} bytes, the file holds {len(raw)} after the length")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _unreadable(file, f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _unreadable(file, f"header is a {type(header).__name__}; expected a JSON object")
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(file, base, name, info)
    return entries


def _entry(file: Path, base: int, name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict):
        raise _unreadable(file, f"tensor `{name}` has header {info!r}; expected dtype, shape, data_offsets")
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise _unreadable(file, f"tensor `{name}` has dtype {info.get('dtype')!r}; expected one of "
                                f"{sorted(SAFETENSORS_DTYPES)}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise _unreadable(file, f"tensor `{name}` has shape {shape!r}; expected a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _unreadable(file, f"tensor `{name}` has data_offsets {offsets!r}; expected [begin, end]")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _unreadable(file, f"tensor `{name}` spans {offsets[1] - offsets[0]} bytes; its dtype and shape "
                                f"{tuple(shape)} need {nbytes}")
    return TensorEntry(name, file, dtype, tuple(shape), base + offsets[0], nbytes)


def read_headers(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor the files declare, from their headers only; a name in two files is an error."""
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in entries:
                raise CheckpointFormatError(f"{file}: tensor `{name}` also appears in {entries[name].file.name}; "
                                            "expected each tensor once. Fix: re-export the checkpoint.")
            entries[name] = entry
    return entries


def check_complete(entries: dict[str, TensorEntry]) -> None:
    """Refuse a file shorter than the bytes its header promises (a truncated download), before reading any data."""
    sizes: dict[Path, int] = {}
    for entry in entries.values():
        size = sizes.setdefault(entry.file, entry.file.stat().st_size)
        if entry.offset + entry.nbytes > size:
            end = entry.offset + entry.nbytes
            raise _unreadable(entry.file, f"tensor `{entry.name}` lies at bytes {entry.offset}..{end}; the file "
                                          f"ends at {size}: it is truncated")


def read_tensor(entry: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One tensor's data, read from its file straight into a new tensor of its stored dtype, then converted to
    ``dtype`` (when given and different): one tensor in memory at a time, no mapping of the whole file."""
    stored = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.nbytes:
        target = memoryview(stored.reshape(-1).view(torch.uint8).numpy())
        with entry.file.open("rb", buffering=0) as handle:
            handle.seek(entry.offset)
            done = 0
            while done < entry.nbytes:
                count = handle.readinto(target[done:])
                if not count:
                    raise _unreadable(entry.file, f"tensor `{entry.name}` ends past the end of the file: it is "
                                                  "truncated")
                done += count
    return stored if dtype is None or dtype == entry.dtype else stored.to(dtype)


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the given safetensors files, in their stored dtypes; a name in two files is an error."""
    entries = read_headers(files)
    check_complete(entries)
    return {name: read_tensor(entry) for name, entry in entries.items()}
