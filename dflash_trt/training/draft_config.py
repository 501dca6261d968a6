"""A fresh drafter's config derived from its target (docs/algorithm.md §2.2, §2.3).

The drafter copies the target's width, heads, MLP width, norm epsilon, RoPE, vocabulary and
maximum positions, so the two share embeddings, LM head and absolute positions. Only the depth,
the block length, the mask token and the tapped layers are choices.
"""

from __future__ import annotations

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import IncompatiblePairError, field_error
from dflash_trt.model.draft_head import build_target_layer_ids


def draft_config_for(target: TargetConfig, *, num_layers: int = 1, block_len: int = 16, mask_token_id: int,
                     target_layer_ids: tuple[int, ...] | None = None,
                     intermediate_size: int | None = None) -> DraftConfig:
    """A full-attention DFlash drafter for ``target`` with ``num_layers`` layers and ``block_len`` slots.

    ``target_layer_ids`` defaults to ``build_target_layer_ids(N, num_layers)`` (docs/algorithm.md §2.3).
    ``intermediate_size`` defaults to the target's; a wider MLP is a cheap way to add capacity to a
    drafter of a very small target (the z-lab format stores it, so every loader accepts it).
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
    return DraftConfig(
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
