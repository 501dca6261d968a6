"""Checkpoint pair -> validated ``ModelPair`` (the builder's front door, docs/design.md §2).

A target is an HF Llama/Qwen3 folder or a llama2.c ``.bin``; a drafter is a z-lab DFlash folder.
``validate_pair`` checks everything the draft-verify loop relies on and refuses with the field,
what was found, what was expected, and the fix.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint
from dflash_trt.formats.safe_files import is_torch_pickle, read_headers, read_json, refuse_pickle, safetensors_files
from dflash_trt.formats.target_checkpoint import (find_llama2c_model, load_hf_target, load_llama2c_target,
                                                 refuse_non_finite)
from dflash_trt.config import DraftConfig, RopeConfig, TargetConfig
from dflash_trt.errors import CheckpointFormatError, IncompatiblePairError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.pair import ModelPair
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
"""What ``--dtype`` accepts: ``auto`` is the checkpoint's own dtype (:func:`checkpoint_dtype`)."""
SESSION_DTYPE = "auto"
"""The dtype ``run``, ``serve`` and ``bench`` load checkpoints in without ``--dtype``: the checkpoint's own (a bf16
target runs in frames and stays lossless, docs/algorithm.md §3.7, at half the weights and KV cache)."""


def embedded_target_path() -> Path:
    """stories260K (llama2.c, MIT) shipped inside the package."""
    return Path(str(resources.files("dflash_trt") / "assets" / "stories260K" / "stories260K.bin"))


def embedded_draft_path() -> Path:
    """The DFlash drafter trained for stories260K, shipped inside the package (z-lab format)."""
    return Path(str(resources.files("dflash_trt") / "assets" / "stories260K-dflash"))


def resolve_dtype(name: str, target: str | Path | None = None) -> torch.dtype:
    """``name`` as a torch dtype; ``auto`` is ``target``'s stored dtype (the embedded target's when None)."""
    if name == "auto":
        return DTYPES[checkpoint_dtype(target if target is not None else embedded_target_path())]
    if name not in DTYPES:
        raise CheckpointFormatError(f"dtype is {name!r}; expected one of {list(DTYPE_CHOICES)}. Fix: pass --dtype "
                                    "float32 (or auto: the checkpoint's).")
    return DTYPES[name]


def checkpoint_dtype(path: str | Path) -> str:
    """The dtype a target checkpoint stores its weights in: ``config.json``'s ``torch_dtype`` (``dtype`` in
    transformers 5), else the floating dtype holding most bytes in its safetensors headers; llama2.c files hold
    float32. Reads no weight."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if (folder / "config.json").is_file() and path.is_dir():
        raw = read_json(folder / "config.json", "target config.json")
        for key in ("torch_dtype", "dtype"):
            if raw.get(key) in DTYPES:
                return raw[key]
        stored: dict[str, int] = {}
        for entry in read_headers(safetensors_files(folder)).values():
            name = str(entry.dtype).removeprefix("torch.")
            if name in DTYPES:
                stored[name] = stored.get(name, 0) + entry.nbytes
        if stored:
            return max(stored, key=stored.__getitem__)
    return "float32"


def load_target(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[TargetModel, Tokenizer | None]:
    """Load a target from an HF folder, a llama2.c ``.bin`` file, or a folder holding one."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: does not exist; expected a target checkpoint (HF folder with "
                                    "config.json, or a llama2.c .bin). Fix: check the --target path.")
    if path.is_file():
        if path.suffix in (".pt", ".pth") or is_torch_pickle(path):
            raise refuse_pickle(path)
        if path.suffix == ".bin":
            return load_llama2c_target(path, dtype)
        raise CheckpointFormatError(f"{path}: is a {path.suffix or 'suffix-less'} file; expected a checkpoint folder "
                                    "with config.json or a llama2.c .bin. Fix: pass the folder that holds it.")
    if (path / "config.json").is_file():
        if (path / "hf_quant_config.json").is_file():  # a ModelOpt FP8/NVFP4 export (model/quantize.py)
            from dflash_trt.formats.quantized_checkpoint import load_quantized_target

            model, tokenizer = load_quantized_target(path)
            refuse_non_finite(model.state_dict(), str(path))  # the dequantized weights the loop runs
            return model.to(dtype), tokenizer
        return load_hf_target(path, dtype)
    model_file = find_llama2c_model(path)
    if model_file is not None:
        return load_llama2c_target(model_file, dtype)
    raise CheckpointFormatError(f"{path}: holds no config.json and no single llama2.c .bin; expected a target "
                                "checkpoint. Fix: pass an HF folder or the .bin file itself.")


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32) -> DraftHead:
    """Load a z-lab DFlash or DFlash2 drafter folder (strict: unknown architectures and tensors refused)."""
    return load_draft_checkpoint(path, dtype)


def validate_pair(target: TargetConfig, draft: DraftConfig, source: str = "pair") -> None:
    """Refuse a target/drafter combination the draft-verify loop cannot run losslessly and usefully."""
    checks = [
        ("hidden_size", draft.hidden_size, target.hidden_size, "a drafter trained for this target"),
        ("vocab_size", draft.vocab_size, target.vocab_size, "a drafter built for this tokenizer"),
        ("num_target_layers", draft.num_target_layers, target.num_layers,
         "the drafter trained for this target (it taps layers by index)"),
    ]
    for field, found, expected, fix in checks:
        if found != expected:
            raise IncompatiblePairError(f"{source}: drafter field `{field}` is {found}; expected the target's "
                                        f"{expected}. Fix: use {fix}, or train one with `dflash-trt train --target "
                                        "TARGET --out DIR`.")
    if draft.mask_token_id >= target.vocab_size:
        raise IncompatiblePairError(f"{source}: drafter field `dflash_config.mask_token_id` is {draft.mask_token_id}; "
                                    f"expected a row of the target embedding, < {target.vocab_size}. Fix: set it to "
                                    "an unused (padded or special) token id of the target.")
    bad_taps = [i for i in draft.target_layer_ids if i >= target.num_layers]
    if bad_taps:
        raise IncompatiblePairError(f"{source}: drafter field `dflash_config.target_layer_ids` contains {bad_taps}; "
                                    f"expected ids < the target's {target.num_layers} layers. Fix: use the drafter "
                                    "trained for this target.")
    if draft.rope != target.rope:  # theta, kind and every scaling field: positions are shared (docs/algorithm.md §2.6)
        raise IncompatiblePairError(f"{source}: drafter RoPE is {_rope_text(draft.rope)}; expected the target's "
                                    f"{_rope_text(target.rope)}: positions are shared with the target. Fix: copy "
                                    "`rope_theta`/`rope_scaling` from the target config into the drafter config.")


def _rope_text(rope: RopeConfig) -> str:
    if rope.kind == "default":
        return f"theta={rope.theta} (default)"
    return f"theta={rope.theta} ({rope.kind}: " + ", ".join(
        f"{k}={v}" for k, v in rope.model_dump(exclude={"theta", "kind"}).items()) + ")"


def load_pair(target: str | Path | None = None, draft: str | Path | None = None, *, dtype: str = "float32",
              use_draft: bool = True) -> ModelPair:
    """Load and validate a pair; ``None`` paths mean the embedded stories260K pair. ``dtype`` is one of
    :data:`DTYPE_CHOICES` (``auto``: the target checkpoint's); both models load straight into it."""
    target_path = Path(target) if target is not None else embedded_target_path()
    torch_dtype = resolve_dtype(dtype, target_path)
    if draft is None and target is None:
        draft = embedded_draft_path()
    target_model, tokenizer = load_target(target_path, torch_dtype)
    draft_model = None
    if draft is not None and use_draft:
        draft_model = load_draft(draft, torch_dtype)
        validate_pair(target_model.config, draft_model.config, f"{target_path} + {draft}")
    return ModelPair(target_model, draft_model, tokenizer, target_path, Path(draft) if draft is not None else None)
