"""Describe a checkpoint or a pair without running it (``dflash-trt inspect``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trt.builder.draft_checkpoint import parse_draft_config
from dflash_trt.builder.load import load_draft, load_target, validate_pair
from dflash_trt.builder.safe_files import read_json
from dflash_trt.errors import DFlashError


def _is_drafter(path: Path) -> bool:
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return False
    architectures = read_json(config, "config.json").get("architectures") or []
    return any("DFlash" in name for name in architectures)


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Kind, format and normalised config of a target or drafter checkpoint (loads it to check tensors)."""
    path = Path(path)
    if _is_drafter(path):
        parse_draft_config(read_json(path / "config.json", "config.json"), str(path / "config.json"))
        head = load_draft(path)
        params = sum(p.numel() for p in head.parameters())
        return {"path": str(path), "kind": "drafter", "format": "z-lab DFlash (DFlashDraftModel)",
                "parameters": params, "config": head.config.model_dump(mode="json")}
    model, tokenizer = load_target(path)
    params = sum(p.numel() for name, p in model.named_parameters())
    source = "HF safetensors" if (path / "config.json").is_file() else "llama2.c"
    return {"path": str(path), "kind": "target", "format": f"{model.config.family} ({source})", "parameters": params,
            "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None,
            "config": model.config.model_dump(mode="json")}


def describe_pair(target: str | Path, draft: str | Path) -> dict[str, Any]:
    """Both descriptions plus ``compatible`` and, when not, the reason with its fix."""
    target_info = describe_checkpoint(target)
    draft_info = describe_checkpoint(draft)
    result = {"target": target_info, "draft": draft_info, "compatible": True, "reason": None}
    try:
        if target_info["kind"] != "target" or draft_info["kind"] != "drafter":
            raise DFlashError(f"expected a target then a drafter; got a {target_info['kind']} then a "
                              f"{draft_info['kind']}. Fix: `dflash-trt inspect TARGET --draft DRAFTER`.")
        model, _ = load_target(target)
        validate_pair(model.config, load_draft(draft).config, f"{target} + {draft}")
    except DFlashError as exc:
        result.update(compatible=False, reason=str(exc))
    return result
