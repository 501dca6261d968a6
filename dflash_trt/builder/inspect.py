"""Describe a checkpoint or a pair without running it (``dflash-trt inspect``).

Reads ``config.json`` and the safetensors headers only (a llama2.c file: its 28-byte header and size), never a
weight: every tensor the config calls for is checked by name and shape against the headers (missing and extra
tensors named), and a pair is checked from the two configs. The values themselves (non-finite weights, a
truncated file) are checked when a command loads them. A ModelOpt quantized folder is loaded and dequantized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_trt.formats.draft_checkpoint import check_draft_tensors, read_draft_config
from dflash_trt.formats.load import load_target, validate_pair
from dflash_trt.formats.safe_files import (TensorEntry, is_torch_pickle, read_headers, read_json, refuse_pickle,
                                         safetensors_files)
from dflash_trt.formats.target_checkpoint import (check_state_dict, expected_tensors, find_llama2c_model,
                                                 hf_target_entries, read_hf_target_config, read_llama2c_header)
from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import CheckpointFormatError, DFlashError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel


def _is_drafter(path: Path) -> bool:
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return False
    architectures = read_json(config, "config.json").get("architectures") or []
    return any("DFlash" in name for name in architectures)


def _weights(entries: dict[str, TensorEntry]) -> dict[str, Any]:
    """Stored dtype(s), bytes and file count of the tensors a model uses (from the headers)."""
    dtypes = sorted({str(e.dtype).removeprefix("torch.") for e in entries.values()})
    return {"dtype": dtypes[0] if len(dtypes) == 1 else "mixed: " + ", ".join(dtypes),
            "weight_bytes": sum(e.nbytes for e in entries.values()),
            "weight_files": len({e.file for e in entries.values()})}


def _describe_drafter(path: Path) -> tuple[dict[str, Any], DraftConfig]:
    config = read_draft_config(path)
    entries = read_headers(safetensors_files(path))
    check_draft_tensors(DraftHead.without_weights(config), entries, str(path))  # the key table, no weights
    model = "DFlash2 (DFlash2DraftModel)" if config.architecture == "dflash2" else "DFlash (DFlashDraftModel)"
    return ({"path": str(path), "kind": "drafter", "format": f"z-lab {model}",
             "parameters": sum(e.numel for e in entries.values()), **_weights(entries),
             "backends": _drafter_backends(config), "config": config.model_dump(mode="json")}, config)


def _drafter_backends(config: DraftConfig) -> str:
    """Which ``build``/``run`` backends take this drafter, and why one does not."""
    if config.architecture != "dflash2":
        return "torch, onnxruntime, tensorrt, trtllm"
    from dflash_trt.builder.bundle_trtllm import DFLASH2_ALTERNATIVES, DFLASH2_UNSERVED

    return f"torch, onnxruntime, tensorrt; not trtllm ({DFLASH2_UNSERVED}: {DFLASH2_ALTERNATIVES})"


def _target_info(path: Path, config: TargetConfig, source: str, tokenizer: str | None,
                 weights: dict[str, Any], parameters: int) -> dict[str, Any]:
    return {"path": str(path), "kind": "target", "format": f"{config.family} ({source})", "parameters": parameters,
            "tokenizer": tokenizer, **weights, "config": config.model_dump(mode="json")}


def _describe_target(path: Path) -> tuple[dict[str, Any], TargetConfig]:
    if path.is_dir() and (path / "config.json").is_file():
        if (path / "hf_quant_config.json").is_file():  # a ModelOpt export: its key table is the dequantizer's
            model, tokenizer = load_target(path)
            params = sum(p.numel() for p in model.parameters())
            return _target_info(path, model.config, "HF safetensors",
                                type(tokenizer).__name__ if tokenizer is not None else None, {}, params), model.config
        config = read_hf_target_config(path)
        entries = hf_target_entries(path, config)
        check_state_dict(expected_tensors(TargetModel.without_weights(config)), entries, str(path))
        # tokenizer.json is named, not parsed (a 151k-token vocabulary costs more than every header)
        tokenizer = "HFTokenizer" if (path / "tokenizer.json").is_file() else None
        return _target_info(path, config, "HF safetensors", tokenizer, _weights(entries),
                            sum(e.numel for e in entries.values())), config
    model_file = path if path.is_file() else find_llama2c_model(path) if path.is_dir() else None
    if model_file is not None and (model_file.suffix in (".pt", ".pth") or is_torch_pickle(model_file)):
        raise refuse_pickle(model_file)
    if model_file is None or model_file.suffix != ".bin":
        load_target(path)  # the loader's own refusal for what is neither an HF folder nor a llama2.c file
        raise CheckpointFormatError(f"{path}: not a target checkpoint. Fix: pass an HF folder or a llama2.c .bin.")
    config, shapes = read_llama2c_header(model_file)
    tokenizer = next(("Llama2cTokenizer" for name in ("tok512.bin", "tokenizer.bin")
                      if model_file.with_name(name).is_file()), None)
    arrays = {name: shape for name, shape in shapes.items() if name != "legacy_rope"}
    params = sum(int(torch.Size(shape).numel()) for shape in arrays.values())
    weights = {"dtype": "float32", "weight_bytes": 4 * params, "weight_files": 1}
    return _target_info(path, config, "llama2.c", tokenizer, weights, params), config


def _describe(path: str | Path) -> tuple[dict[str, Any], TargetConfig | DraftConfig]:
    path = Path(path)
    return _describe_drafter(path) if _is_drafter(path) else _describe_target(path)


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Kind, format, stored dtype and bytes, and normalised config of a target or drafter checkpoint, with every
    tensor's name and shape checked against its config (headers only: no weight is read)."""
    return _describe(path)[0]


def describe_pair(target: str | Path, draft: str | Path) -> dict[str, Any]:
    """Both descriptions plus ``compatible`` and, when not, the reason with its fix (each checkpoint read once)."""
    target_info, target_config = _describe(target)
    draft_info, draft_config = _describe(draft)
    result = {"target": target_info, "draft": draft_info, "compatible": True, "reason": None}
    try:
        if target_info["kind"] != "target" or draft_info["kind"] != "drafter":
            raise DFlashError(f"expected a target then a drafter; got a {target_info['kind']} then a "
                              f"{draft_info['kind']}. Fix: `dflash-trt inspect TARGET --draft DRAFTER`.")
        validate_pair(target_config, draft_config, f"{target} + {draft}")
    except DFlashError as exc:
        result.update(compatible=False, reason=str(exc))
    return result
