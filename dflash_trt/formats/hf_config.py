"""Hugging Face ``config.json`` -> ``TargetConfig`` for Llama and Qwen3, and the shared RoPE parser.

``rope_scaling_json`` and ``target_config_json`` are the inverses (what the builder writes for
transformers, TensorRT-LLM, vLLM and SGLang). Accepts both RoPE layouts: flat ``rope_theta`` (+ ``rope_scaling``)
and transformers-5 ``rope_parameters: {rope_theta, rope_type, ...}`` (docs/algorithm.md §5.3).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dflash_trt.config import RopeConfig, TargetConfig
from dflash_trt.errors import CheckpointFormatError, UnsupportedArchitectureError

SUPPORTED_TARGETS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_ROPE_KINDS = ("default", "linear", "llama3")


def parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    """RoPE settings from either layout; refuses scaling kinds we do not implement (e.g. YaRN)."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta"))
        scaling = params if params.get("rope_type", "default") != "default" else scaling
    else:
        theta = raw.get("rope_theta", 10000.0)
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointFormatError(f"{source}: field `rope_theta` is {theta!r}; expected a positive number "
                                    "(flat, or inside `rope_parameters`). Fix: copy it from the model card.")
    if not scaling:
        return RopeConfig(theta=theta)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise UnsupportedArchitectureError(f"{source}: field `rope_scaling.rope_type` is {kind!r}; expected one of "
                                           f"{list(_ROPE_KINDS)}. Fix: use a checkpoint without {kind} scaling.")
    extra = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings") if k in scaling}
    return RopeConfig(theta=theta, kind=kind, **extra)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def parse_target_config(raw: dict[str, Any], source: str) -> TargetConfig:
    """Normalise an HF ``config.json`` dict for ``LlamaForCausalLM``/``Qwen3ForCausalLM``."""
    architectures = raw.get("architectures") or []
    family = next((SUPPORTED_TARGETS[a] for a in architectures if a in SUPPORTED_TARGETS), None)
    if family is None:
        if "DFlashDraftModel" in architectures or "DFlash2DraftModel" in architectures:
            raise UnsupportedArchitectureError(f"{source}: is a DFlash drafter, not a target; expected "
                                               f"architectures {sorted(SUPPORTED_TARGETS)}. Fix: pass it as --draft.")
        raise UnsupportedArchitectureError(f"{source}: field `architectures` is {architectures!r}; expected one of "
                                           f"{sorted(SUPPORTED_TARGETS)}. Fix: use a Llama or Qwen3 checkpoint.")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"{source}: field `hidden_act` is {raw['hidden_act']!r}; expected 'silu' "
                                           "(SwiGLU). Fix: use a Llama or Qwen3 checkpoint.")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(raw.get(key), int):
            raise CheckpointFormatError(f"{source}: field `{key}` is {raw.get(key)!r}; expected an integer. "
                                        "Fix: use the config.json saved with the weights.")
    heads = raw["num_attention_heads"]
    try:
        return TargetConfig(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=parse_rope(raw, source),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CheckpointFormatError(f"{source}: {'.'.join(map(str, first['loc'])) or 'config'}: {first['msg']} "
                                    f"(found {first.get('input')!r}). Fix: correct config.json.") from None


def rope_scaling_json(rope: RopeConfig) -> dict[str, Any] | None:
    """``rope_scaling`` for ``rope`` (None for default RoPE); every field, so parsing gives back the same config."""
    if rope.kind == "default":
        return None
    return {"rope_type": rope.kind, **rope.model_dump(exclude={"theta", "kind"})}


def target_config_json(config: TargetConfig, dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` for ``config`` that ``parse_target_config`` and transformers read back."""
    architecture = next(name for name, family in SUPPORTED_TARGETS.items() if family == config.family)
    eos = list(config.eos_token_ids)
    return {
        "architectures": [architecture], "model_type": config.family, "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope.theta,
        "rope_scaling": rope_scaling_json(config.rope), "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "dtype": dtype,
    }
