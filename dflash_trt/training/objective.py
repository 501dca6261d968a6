"""The DFlash training objective (docs/algorithm.md §4): anchors, blocks, the block-diagonal mask, the decayed CE.

Per sequence, anchors ``a_j`` are drawn without replacement among the positions whose whole block
fits (``1 <= a_j <= len - B``), then sorted. Block ``j`` is ``[ids[a_j], MASK x (B-1)]`` at positions
``a_j .. a_j+B-1``; every block of every sequence goes through the drafter in one forward next to the
clean context. Slot ``k >= 1`` of block ``j`` predicts ``ids[a_j + k]`` (no shift, §2.8) with weight
``w_k = exp(-(k-1)/gamma)``; the loss is ``sum w_k CE_k / sum w_k`` over the valid slots.

Anchor 0 is excluded: at inference the first anchor follows a prompt of at least one token, so a
block always has some context. All functions here are pure. Which keys a block slot sees is the model's rule
(:func:`~dflash_trt.model.block_attention.block_visibility`), shared with inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.model.block_attention import block_visibility

#: γ of the paper's recipe for the two published block lengths (docs/algorithm.md §4).
PUBLISHED_GAMMA = {16: 7.0, 8: 4.0}


def decay_gamma(block_len: int) -> float:
    """γ of the slot weights: 7 for B=16 and 4 for B=8 (docs/algorithm.md §4); other B use the line through
    those two points, ``γ = 1 + 3B/8`` (B=4 -> 2.5, B=32 -> 13), so γ stays proportional to the
    number of slots the drafter can usefully get right."""
    return PUBLISHED_GAMMA.get(block_len, 1.0 + 3.0 * block_len / 8.0)


def slot_weights(block_len: int, gamma: float | None = None) -> Tensor:
    """``w_k = exp(-(k-1)/γ)`` for slots ``k = 1..B-1``. Shape ``[B-1]`` (float32)."""
    gamma = decay_gamma(block_len) if gamma is None else gamma
    k = torch.arange(1, block_len, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(length: int, block_len: int, max_anchors: int, generator: torch.Generator) -> Tensor:
    """Sorted anchors drawn without replacement from ``1 .. length-B`` (the block fits), at most ``max_anchors``.

    Shapes: -> ``[J]`` int64, ``J = min(max_anchors, max(0, length - B))``.
    """
    candidates = length - block_len  # positions 1 .. length-B
    if candidates <= 0:
        return torch.empty(0, dtype=torch.long)
    order = torch.randperm(candidates, generator=generator)[:max_anchors]
    return (order + 1).sort().values


def block_token_ids(tokens: Tensor, anchors: Tensor, block_len: int, mask_token_id: int) -> Tensor:
    """Draft inputs ``[ids[a_j], MASK x (B-1)]``. Shapes: tokens ``[S]``, anchors ``[J]`` -> ``[J, B]``."""
    blocks = torch.full((anchors.shape[0], block_len), mask_token_id, dtype=torch.long)
    blocks[:, 0] = tokens[anchors]
    return blocks


def block_labels(tokens: Tensor, anchors: Tensor, block_len: int) -> Tensor:
    """Labels of slots 1..B-1: ``ids[a_j + k]``. Shapes: tokens ``[S]``, anchors ``[J]`` -> ``[J, B-1]``."""
    offsets = torch.arange(1, block_len)
    return tokens[anchors.unsqueeze(1) + offsets]


def block_diagonal_mask(anchors: Tensor, context_len: int, block_len: int, causal: bool = False) -> Tensor:
    """The dense training mask over ``[context ; block_0 ; ... ; block_{J-1}]`` keys, for reference and tests.

    Row ``j*B + t`` sees context positions ``< a_j`` and its own block (causally if ``causal``), no other block.
    Shapes: anchors ``[J]`` -> bool ``[J*B, context_len + J*B]``.
    """
    count = anchors.shape[0]
    tiles = block_visibility(anchors, context_len, block_len, causal)  # [J, B, S+B]
    dense = torch.zeros(count * block_len, context_len + count * block_len, dtype=torch.bool)
    for j in range(count):
        rows = slice(j * block_len, (j + 1) * block_len)
        dense[rows, :context_len] = tiles[j, :, :context_len]
        own = slice(context_len + j * block_len, context_len + (j + 1) * block_len)
        dense[rows, own] = tiles[j, :, context_len:]
    return dense


def weighted_block_loss(logits: Tensor, labels: Tensor, valid: Tensor, weights: Tensor) -> Tensor:
    """``Σ w_k · CE_k / Σ w_k`` over valid slots (docs/algorithm.md §4).

    Shapes: logits ``[R, B-1, V]``, labels ``[R, B-1]``, valid ``[R, B-1]`` bool, weights ``[B-1]`` -> scalar.
    """
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    w = weights.to(ce.device).expand_as(ce) * valid
    return (ce * w).sum() / w.sum().clamp_min(1e-12)


def accepted_prefix(predictions: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """Greedy acceptance per block: length of the leading run of slots where the prediction equals the label.

    ``acc_j = Σ_i Π_{k<=i} 1[x_k = y_k]`` (docs/algorithm.md §3.3, the label standing in for the target's choice).
    Shapes: predictions, labels, valid ``[R, B-1]`` -> ``[R]`` int64.
    """
    hits = (predictions == labels) & valid
    return hits.long().cumprod(dim=-1).sum(dim=-1)

