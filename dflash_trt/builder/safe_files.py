"""Safe tensor-file access: safetensors only, never a pickle, never a file outside the checkpoint.

torch ``.bin``/``.pt`` files are pickles that can run arbitrary code when loaded; we refuse
them by content (zip or pickle magic), not by name, and point at the safetensors conversion.
Shards named by a ``model.safetensors.index.json`` must lie inside its folder (no absolute
paths, ``..`` or symbolic links pointing out).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

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


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the given safetensors files; a name in two files is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if is_torch_pickle(file):  # by content: a pickle renamed to .safetensors is still refused as one
            raise refuse_pickle(file)
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise CheckpointFormatError(f"{file}: tensor `{name}` also appears in another shard; "
                                                    "expected each tensor once. Fix: re-export the checkpoint.")
                    tensors[name] = handle.get_tensor(name)
        except CheckpointFormatError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointFormatError(f"{file}: cannot be read as safetensors ({exc}). Fix: re-download or "
                                        "re-export the file.") from None
    return tensors
