"""Read and write DFlash and DFlash2 drafters in the z-lab checkpoint format, unchanged (docs/algorithm.md §5).

``config.json`` is a Qwen3 config plus ``num_target_layers``, ``block_size`` and
``dflash_config``; ``model.safetensors`` holds ``fc``, ``hidden_norm``, ``norm`` and 11 tensors
per layer, no prefix, no embedding and no LM head. A ``DFlash2DraftModel`` adds four convolution
tensors per layer and the candidate selector's three (§5.5); its two codebooks are stored without a
``.weight`` suffix in released checkpoints, and either spelling loads. Keys are looked up in
``dflash_config`` first, then at the top level, then a default, as the reference does. Loading is
strict: an unknown architecture or any unmapped tensor is refused, never loaded partially.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from dflash_trt.formats.hf_config import parse_rope, rope_scaling_json
from dflash_trt.formats.safe_files import read_headers, read_json, safetensors_files
from dflash_trt.formats.target_checkpoint import stream_weights
from dflash_trt.config import DFLASH2_FIELDS, DraftConfig
from dflash_trt.errors import CheckpointFormatError, UnsupportedArchitectureError
from dflash_trt.model.draft_head import DraftHead, build_target_layer_ids

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_V2 = "DFlash2DraftModel"
_ARCHITECTURES = {ARCHITECTURE: "dflash", ARCHITECTURE_V2: "dflash2"}
_CODEBOOKS = tuple(f"candidate_selector.{name}" for name in ("predecessor_codebook", "successor_codebook"))
"""Released DFlash2 checkpoints store these embedding tables under the module name, without ``.weight``."""
DEFAULT_BLOCK_SIZE = 16
_LOGIT_DEFAULTS = {"output_multiplier": 1.0, "final_logit_softcapping": None}
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def _lookup(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    """``dflash_config[key]``, then top-level ``key``, then ``default`` (reference lookup order)."""
    inner = raw.get("dflash_config") or {}
    if key in inner and inner[key] is not None:
        return inner[key]
    if key in raw and raw[key] is not None:
        return raw[key]
    return default


def _check_identity(raw: dict[str, Any], source: str) -> str:
    """A DFlash or DFlash2 drafter (Qwen3 body, a ``dflash_config``): returns ``dflash`` or ``dflash2`` (§5.4)."""
    architectures = raw.get("architectures")
    known = isinstance(architectures, list) and len(architectures) == 1 and architectures[0] in _ARCHITECTURES
    if not known:
        if raw.get("speculators_model_type") == "dflash":
            raise UnsupportedArchitectureError(
                f"{source}: is a vLLM speculators checkpoint (`speculators_model_type: dflash`); expected the z-lab "
                f"format with architectures ['{ARCHITECTURE}']. Fix: convert it (target_layer_ids = "
                "aux_hidden_state_layer_ids - 1, body tensors unchanged).")
        raise UnsupportedArchitectureError(
            f"{source}: field `architectures` is {architectures!r}; expected ['{ARCHITECTURE}'] or "
            f"['{ARCHITECTURE_V2}']. Fix: pass a z-lab DFlash or DFlash2 drafter folder (config.json + "
            "model.safetensors) as --draft.")
    if not isinstance(raw.get("dflash_config"), dict):
        raise CheckpointFormatError(f"{source}: field `dflash_config` is {raw.get('dflash_config')!r}; expected an "
                                    "object with `mask_token_id` (and optionally `target_layer_ids`). Fix: add it.")
    if raw.get("model_type") != "qwen3":
        raise UnsupportedArchitectureError(f"{source}: field `model_type` is {raw.get('model_type')!r}; expected "
                                           "'qwen3' (DFlash drafters are Qwen3 decoder stacks). Fix: pass a z-lab "
                                           "DFlash drafter; other draft families are not supported.")
    return _ARCHITECTURES[architectures[0]]


def _dflash2_fields(raw: dict[str, Any], source: str) -> dict[str, int]:
    """The four DFlash2 ``dflash_config`` integers (looked up as every DFlash key is), each a positive int."""
    fields = {}
    for key in DFLASH2_FIELDS:
        value = _lookup(raw, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointFormatError(
                f"{source}: field `dflash_config.{key}` is {value!r}; expected a positive integer (a "
                f"{ARCHITECTURE_V2} needs conv_kernel_size, conv_group_size, selector_rank and selector_top_k). "
                "Fix: copy it from the drafter's published config.json.")
        fields[key] = value
    return fields


def _layer_types(raw: dict[str, Any], num_layers: int, source: str) -> list[str]:
    """``layer_types``, or what transformers' Qwen3Config derives from ``use_sliding_window``/``max_window_layers``."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        windowed = bool(raw.get("use_sliding_window")) and raw.get("sliding_window") is not None
        first_sliding = raw.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if windowed and i >= first_sliding else "full_attention"
                       for i in range(num_layers)]
    unknown = [kind for kind in layer_types if kind not in _LAYER_TYPES]
    if unknown:
        raise UnsupportedArchitectureError(f"{source}: field `layer_types` contains {unknown!r}; expected only "
                                           f"{sorted(_LAYER_TYPES)}. Fix: use a DFlash (v1) drafter; other "
                                           "attention kinds are not implemented.")
    return layer_types


def parse_draft_config(raw: dict[str, Any], source: str) -> DraftConfig:
    """Normalise a z-lab ``config.json`` dict into a ``DraftConfig``, refusing what we cannot run."""
    architecture = _check_identity(raw, source)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(raw.get(key), int):
            raise CheckpointFormatError(f"{source}: field `{key}` is {raw.get(key)!r}; expected an integer. "
                                        "Fix: copy it from the target's config.json.")
    num_target_layers = _lookup(raw, "num_target_layers")
    if not isinstance(num_target_layers, int) or num_target_layers < 1:
        raise CheckpointFormatError(f"{source}: field `num_target_layers` is {num_target_layers!r}; expected the "
                                    "target's decoder layer count. Fix: add `\"num_target_layers\": N`.")
    mask_token_id = _lookup(raw, "mask_token_id")
    if not isinstance(mask_token_id, int):
        raise CheckpointFormatError(f"{source}: field `dflash_config.mask_token_id` is {mask_token_id!r}; expected "
                                    "the id of an unused row of the target embedding. Fix: add it to dflash_config.")
    num_layers = raw["num_hidden_layers"]
    layer_ids = _lookup(raw, "target_layer_ids")
    if layer_ids is None:
        layer_ids = build_target_layer_ids(num_target_layers, num_layers)
    elif not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids):
        raise CheckpointFormatError(f"{source}: field `dflash_config.target_layer_ids` is {layer_ids!r}; expected a "
                                    "list of target layer indices. Fix: write it as a JSON list, e.g. [1, 9, 17].")
    layer_types = _layer_types(raw, num_layers, source)
    window = raw.get("sliding_window")
    softcap = _lookup(raw, "final_logit_softcapping")
    if softcap == 0:  # the reference applies a soft-cap only when it is > 0; 0 means none, as null does
        softcap = None
    fields = dict(
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope=parse_rope(raw, source),
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        attention_bias=bool(raw.get("attention_bias", False)),
        num_target_layers=num_target_layers,
        target_layer_ids=tuple(layer_ids),
        block_size=_lookup(raw, "block_size", DEFAULT_BLOCK_SIZE),
        mask_token_id=mask_token_id,
        layer_sliding=tuple(_LAYER_TYPES[kind] for kind in layer_types),
        sliding_window=window if any(_LAYER_TYPES[k] for k in layer_types) else None,
        is_causal=None if raw.get("is_causal") is None else bool(raw["is_causal"]),
        input_embedding_scale=_lookup(raw, "input_embedding_scale", 1.0),
        output_multiplier=_lookup(raw, "output_multiplier", 1.0),
        final_logit_softcapping=softcap,
        architecture=architecture,
        **(_dflash2_fields(raw, source) if architecture == "dflash2" else {}),
    )
    try:
        return DraftConfig(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        if not where:  # a rule across fields (e.g. conv_group_size and hidden_size): its message names them
            message = first["msg"].removeprefix("Value error, ")
            fix = "" if "fix:" in message else " Fix: correct config.json."
            raise CheckpointFormatError(f"{source}: {message}.{fix}") from None
        raise CheckpointFormatError(f"{source}: {where}: {first['msg']} "
                                    f"(found {first.get('input')!r}). Fix: correct config.json.") from None


def read_draft_config(folder: Path) -> DraftConfig:
    """The drafter's ``config.json``, parsed and checked (refusing a file given as the folder)."""
    if not folder.is_dir():
        raise CheckpointFormatError(f"{folder}: not a folder; expected a DFlash or DFlash2 drafter folder with "
                                    "config.json and model.safetensors. Fix: pass the folder, not a file.")
    return parse_draft_config(read_json(folder / "config.json", "drafter config.json"), str(folder / "config.json"))


def canonical_draft_names(entries: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``entries`` under our module names: a DFlash2 codebook stored as ``candidate_selector.<name>`` (the released
    spelling) becomes ``candidate_selector.<name>.weight``; a checkpoint holding both spellings is refused."""
    renamed = dict(entries)
    for name in _CODEBOOKS:
        if name in renamed:
            if f"{name}.weight" in renamed:
                raise CheckpointFormatError(
                    f"{source}: tensors `{name}` and `{name}.weight` are both present; expected one spelling of "
                    "the codebook. Fix: keep one of them (released DFlash2 drafters store the first).")
            renamed[f"{name}.weight"] = renamed.pop(name)
    return renamed


def check_draft_tensors(head: DraftHead, entries: Mapping[str, Any], source: str) -> None:
    """Refuse unknown, missing or mis-shaped drafter tensors; ``entries`` need only ``.shape`` (headers do).
    Either codebook spelling is accepted (:func:`canonical_draft_names`)."""
    config = head.config
    entries = canonical_draft_names(entries, source)
    expected = head.state_dict()
    unknown = sorted(set(entries) - set(expected))
    missing = sorted(set(expected) - set(entries))
    if unknown or missing:
        raise UnsupportedArchitectureError(
            f"{source}: tensors do not match a {config.num_layers}-layer "
            f"{ARCHITECTURE_V2 if config.architecture == 'dflash2' else ARCHITECTURE} with "
            f"{config.num_taps} taps: unknown {unknown[:6]}{'...' if len(unknown) > 6 else ''}, missing "
            f"{missing[:6]}{'...' if len(missing) > 6 else ''}; expected exactly the z-lab tensor names "
            "(docs/algorithm.md §5.2, §5.5). Fix: use an unmodified z-lab-format drafter whose `architectures` "
            "names what its tensors are; third-party extras are not supported.")
    for name, tensor in entries.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointFormatError(f"{source}: tensor `{name}` has shape {tuple(tensor.shape)}; expected "
                                        f"{tuple(expected[name].shape)} from config.json. Fix: the config does "
                                        "not describe these weights; re-export the drafter.")


def load_draft_checkpoint(folder: str | Path, dtype: torch.dtype = torch.float32) -> DraftHead:
    """Load a z-lab DFlash drafter folder strictly into a ``DraftHead``, streamed into ``dtype`` (headers checked
    first, then one tensor at a time; no random initialisation). It has no embedding or LM head: it borrows the
    target's."""
    folder = Path(folder)
    config = read_draft_config(folder)
    entries = canonical_draft_names(read_headers(safetensors_files(folder)), str(folder))
    head = DraftHead.without_weights(config)
    check_draft_tensors(head, entries, str(folder))
    stream_weights(head, entries, dtype, str(folder))
    return head.to(dtype).eval()


def draft_config_json(config: DraftConfig, dtype: str = "float32") -> dict[str, Any]:
    """The z-lab ``config.json`` for ``config`` (readable by transformers' Qwen3Config and dflash 0.1.0)."""
    dflash2 = config.architecture == "dflash2"
    extras = {key: getattr(config, key) for key in DFLASH2_FIELDS} if dflash2 else {}
    logits = {key: value for key, value in (("output_multiplier", config.output_multiplier),
                                            ("final_logit_softcapping", config.final_logit_softcapping))
              if value != _LOGIT_DEFAULTS[key]}
    if config.input_embedding_scale != 1.0:
        logits["input_embedding_scale"] = config.input_embedding_scale
    return {
        "architectures": [ARCHITECTURE_V2 if dflash2 else ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope.theta,
        "rope_scaling": rope_scaling_json(config.rope),
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in config.layer_sliding],
        "sliding_window": config.sliding_window,
        "use_sliding_window": any(config.layer_sliding),
        "max_window_layers": config.num_layers,
        **({} if config.is_causal is None else {"is_causal": config.is_causal}),
        "tie_word_embeddings": False,
        "dtype": dtype,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                          **extras, **logits},
    }


def save_draft_checkpoint(head: DraftHead, folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``head`` as a z-lab DFlash checkpoint folder (config.json + model.safetensors)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    config = draft_config_json(head.config, dtype_name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # codebooks under the released DFlash2 spelling (no `.weight`), which the reference's from_pretrained maps
    state = {name.removesuffix(".weight") if name.removesuffix(".weight") in _CODEBOOKS else name:
             t.detach().to(dtype).contiguous() for name, t in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
