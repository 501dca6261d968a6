"""Who a draft-block query sees, and attention under that rule: the ``dflash::block_attention`` math.

One rule (docs/algorithm.md §2.5), written once here and used by the draft head at inference and in
training, by the torch op ``dflash::block_attention`` and by the numpy op of ONNX Runtime:

    query at position ``p`` sees a key at position ``k`` iff
    ``k <= p`` (causal layers only)  and  ``|p - k| < window`` (sliding layers; one-sided when causal).

Which keys exist is the caller's layout, not the rule: at inference a block's keys are the cached
context rows before its anchor plus the block itself; in training a block sees the clean
context strictly before its anchor and its own block, never another block (:func:`block_visibility`).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

Positions = TypeVar("Positions")  # an integer torch.Tensor or numpy.ndarray

UNBOUNDED = 2**62
"""A distance no position reaches: the bound of a layer without a window."""


def visible(query_pos: Positions, key_pos: Positions, causal: bool, window: int) -> Positions:
    """The rule: ``0 <= p - k < w`` when causal, ``-w < p - k < w`` otherwise (``w`` unbounded when 0).

    Pure array arithmetic, so it serves torch tensors and numpy arrays alike.
    Shapes: query_pos ``[..., T, 1]``, key_pos ``[..., 1, S]`` (anything that broadcasts) -> bool
    ``[..., T, S]``, True = attend.
    """
    distance = query_pos - key_pos
    reach = window if window else UNBOUNDED
    nearest = 0 if causal else 1 - reach
    return (distance >= nearest) & (distance < reach)


def block_mask(context_len: int, tokens: int, causal: bool, window: int, device: torch.device | str
               ) -> Tensor | None:
    """Mask of the op form: query ``i`` at position ``C+i`` over keys ``0 .. C+T-1``.

    None when every key is visible (full bidirectional layers), so SDPA takes its unmasked path.
    Shapes: -> bool ``[1, 1, T, C+T]``.
    """
    if not causal and not window:
        return None
    queries = torch.arange(context_len, context_len + tokens, device=device).view(tokens, 1)
    keys = torch.arange(context_len + tokens, device=device).view(1, -1)
    return visible(queries, keys, causal, window).view(1, 1, tokens, context_len + tokens)


def block_visibility(anchors: Tensor, context_len: int, block_len: int, causal: bool = False,
                     window: int = 0) -> Tensor:
    """Per-block rows of the training mask (docs/algorithm.md §4): context keys first, then the block's own keys.

    Slot ``t`` of block ``j`` sits at ``a_j + t``; it sees context positions ``< a_j`` and its own
    block, both under :func:`visible`. Blocks never see each other, so only the non-zero tiles of the
    dense block-diagonal mask are materialised.
    Shapes: anchors ``[..., J]`` -> bool ``[..., J, B, context_len + B]``. True = attend.
    """
    slots = torch.arange(block_len, device=anchors.device)
    context_pos = torch.arange(context_len, device=anchors.device)
    anchor = anchors[..., None, None]  # [..., J, 1, 1]
    query_pos = anchor + slots.view(block_len, 1)  # [..., J, B, 1]
    key_pos = torch.cat([context_pos.expand(*anchors.shape, 1, context_len),
                         anchor + slots.view(1, block_len)], dim=-1)  # [..., J, 1, S+B]
    exists = torch.cat([context_pos < anchor, torch.ones_like(anchor + slots, dtype=torch.bool)], dim=-1)
    return exists & visible(query_pos, key_pos, causal, window)


def block_attention(q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                    scale: float = 0.0, window: int = 0, causal: int = 0) -> Tensor:
    """Attention of the block over ``[context ‖ block]`` (schema ``dflash::block_attention``, the reference).

    Query ``i`` sits at position ``C+i``; keys are at ``0 .. C+T-1``; ``scale`` 0 means ``d^-0.5``;
    query head ``h`` reads KV head ``h // (nq / nkv)``.
    Shapes: q ``[B, nq, T, d]``; context_k/v ``[B, nkv, C, d]`` (C >= 0); block_k/v ``[B, nkv, T, d]``
    -> ``[B, T, nq*d]``.
    """
    keys = torch.cat([context_k, block_k], dim=2)
    values = torch.cat([context_v, block_v], dim=2)
    mask = block_mask(context_k.shape[2], q.shape[2], bool(causal), window, q.device)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale or None,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    batch, heads, tokens, dim = out.shape
    return out.transpose(1, 2).reshape(batch, tokens, heads * dim)
