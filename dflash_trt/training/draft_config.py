"""A fresh drafter's config derived from its target (docs/algorithm.md §2.2, §2.3).

The drafter copies the target's width, heads, MLP width, norm epsilon, RoPE, vocabulary and
maximum positions, so the two share embeddings, LM head and absolute positions. Only the depth,
the block length, the mask token and the tapped layers are choices, and for a DFlash2 drafter the
convolution and selector sizes (docs/algorithm.md §2.10, §2.11; released defaults in ``DFLASH2_DEFAULTS``).
"""

from __future__ import annotations

from typing import Literal

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import IncompatiblePairError, field_error
from dflash_trt.model.draft_head import build_target_layer_ids

DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
"""The settings of the released DFlash2 drafters (docs/algorithm.md §5.5)."""
_DFLASH2_FLAGS = {"conv_kernel_size": "--conv-kernel-size", "conv_group_size": "--conv-group-size",
                  "selector_rank": "--selector-rank", "selector_top_k": "--selector-top-k"}


def draft_config_for(target: TargetConfig, *, num_layers: int = 1, block_len: int = 16, mask_token_id: int,
                     target_layer_ids: tuple[int, ...] | None = None,
                     intermediate_size: int | None = None, architecture: Literal["dflash", "dflash2"] = "dflash",
                     dflash2: dict[str, int] | None = None) -> DraftConfig:
    """A full-attention DFlash (or DFlash2) drafter for ``target`` with ``num_layers`` layers and ``block_len`` slots.

    ``target_layer_ids`` defaults to ``build_target_layer_ids(N, num_layers)`` (docs/algorithm.md §2.3).
    ``intermediate_size`` defaults to the target's; a wider MLP is a cheap way to add capacity to a
    drafter of a very small target (the z-lab format stores it, so every loader accepts it).
    ``dflash2`` overrides some of ``DFLASH2_DEFAULTS`` (only with ``architecture="dflash2"``).
    """
    source = "draft config"
    if num_layers < 1:
        raise field_error(IncompatiblePairError, source, "num_layers", num_layers, "an integer >= 1",
                          "pass --layers 1 (or more)")
    if block_len < 2:
        raise field_error(IncompatiblePairError, source, "block_len", block_len,
                          "an integer >= 2 (anchor + at least one mask slot)", "pass --block-len 16 (or 8)")
    if block_len > target.max_position_embeddings:
        raise field_error(IncompatiblePairError, source, "block_len", block_len,
                          f"<= the target's max_position_embeddings {target.max_position_embeddings}",
                          "pass a smaller --block-len")
    if not 0 <= mask_token_id < target.vocab_size:
        raise field_error(IncompatiblePairError, source, "mask_token_id", mask_token_id,
                          f"a row of the target embedding, 0 <= id < {target.vocab_size}",
                          "pick an unused (padded or special) token id of the target")
    if intermediate_size is not None and intermediate_size < 1:
        raise field_error(IncompatiblePairError, source, "intermediate_size", intermediate_size, "an integer >= 1",
                          "pass --intermediate-size 512, or omit it to copy the target's")
    ids = tuple(target_layer_ids) if target_layer_ids else build_target_layer_ids(target.num_layers, num_layers)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise field_error(IncompatiblePairError, source, "target_layer_ids", list(ids),
                          f"decoder layer ids in [0, {target.num_layers})",
                          f"pass --target-layer-ids with ids below {target.num_layers}, or omit it for the default "
                          f"{list(build_target_layer_ids(target.num_layers, num_layers))}")
    extras = dflash2_fields(target, architecture, dflash2 or {})
    return DraftConfig(
        architecture=architecture,
        **extras,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_layers=num_layers,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        vocab_size=target.vocab_size,
        max_position_embeddings=target.max_position_embeddings,
        attention_bias=target.attention_bias,
        num_target_layers=target.num_layers,
        target_layer_ids=ids,
        block_size=block_len,
        mask_token_id=mask_token_id,
        layer_sliding=(False,) * num_layers,
    )


def dflash2_fields(target: TargetConfig, architecture: str, given: dict[str, int]) -> dict[str, int]:
    """The DFlash2 fields of the drafter (``{}`` for DFlash), each checked against the target's shapes."""
    source = "draft config"
    if architecture == "dflash":
        if given:
            flags = ", ".join(_DFLASH2_FLAGS.get(name, name) for name in given)
            raise field_error(IncompatiblePairError, source, "architecture", "dflash", "dflash2 when DFlash2 "
                              f"settings are given (got {flags})", f"pass --arch dflash2, or drop {flags}")
        return {}
    unknown = sorted(set(given) - set(DFLASH2_DEFAULTS))
    assert not unknown, unknown  # callers pass DFLASH2_DEFAULTS keys only
    fields = {**DFLASH2_DEFAULTS, **given}
    for name, value in fields.items():
        if value < 1:
            raise field_error(IncompatiblePairError, source, name, value, "an integer >= 1",
                              f"pass {_DFLASH2_FLAGS[name]} {DFLASH2_DEFAULTS[name]} (the released setting)")
    hidden, group = target.hidden_size, fields["conv_group_size"]
    if hidden % group:
        divisors = [d for d in range(1, hidden + 1) if hidden % d == 0]
        raise field_error(IncompatiblePairError, source, "conv_group_size", group,
                          f"a divisor of the target's hidden_size {hidden} (the channels split into equal groups; "
                          f"divisors: {divisors})",
                          f"pass --conv-group-size {max(d for d in divisors if d <= group)}")
    if fields["selector_top_k"] > target.vocab_size:
        raise field_error(IncompatiblePairError, source, "selector_top_k", fields["selector_top_k"],
                          f"at most the target's vocab_size {target.vocab_size}",
                          f"pass --selector-top-k {min(DFLASH2_DEFAULTS['selector_top_k'], target.vocab_size)}")
    return fields
