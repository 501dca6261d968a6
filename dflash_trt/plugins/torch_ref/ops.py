"""The torch reference of every ``plugins/schema.py`` op, bound as ``torch.library`` ops ``dflash::…``.

``block_attention_reference`` is the math every other implementation is held to (parity tests in
``tests/plugins``). Importing this module registers ``torch.ops.dflash.block_attention`` (the ONNX
exporter needs a registered op to emit a plugin node); nothing else happens at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.plugins.schema import BLOCK_ATTENTION


def block_window_mask(context_len: int, tokens: int, window: int, causal: int, device: torch.device) -> Tensor | None:
    """Bool mask ``[1, 1, T, C+T]`` (True = attend) of query ``i`` at position ``C+i`` over keys ``0..C+T-1``.

    None when every key is visible (full bidirectional layers): the same SDPA call as ``model.layers.attend``.
    """
    if window <= 0 and not causal:
        return None
    query = torch.arange(context_len, context_len + tokens, device=device).view(tokens, 1)
    key = torch.arange(context_len + tokens, device=device).view(1, -1)
    mask = torch.ones(tokens, context_len + tokens, dtype=torch.bool, device=device)
    if window > 0:
        mask = mask & ((query - key) < window)
        if not causal:  # a non-causal window is two-sided (reference: dflash/model.py _attention_mask)
            mask = mask & ((key - query) < window)
    if causal:
        mask = mask & (key <= query)
    return mask.view(1, 1, tokens, context_len + tokens)


def block_attention_reference(q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                              scale: float = 0.0, window: int = 0, causal: int = 0) -> Tensor:
    """Attention of the block over ``[context ‖ block]`` (schema ``dflash::block_attention``).

    Shapes: q ``[B, nq, T, d]``; context_k/v ``[B, nkv, C, d]`` (C >= 0); block_k/v ``[B, nkv, T, d]``
    -> ``[B, T, nq*d]``.
    """
    keys = torch.cat([context_k, block_k], dim=2)
    values = torch.cat([context_v, block_v], dim=2)
    mask = block_window_mask(context_k.shape[2], q.shape[2], window, causal, q.device)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale or None,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    batch, heads, tokens, dim = out.shape
    return out.transpose(1, 2).reshape(batch, tokens, heads * dim)


@torch.library.custom_op(BLOCK_ATTENTION.qualified_name, mutates_args=())
def block_attention(q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                    scale: float, window: int, causal: int) -> Tensor:
    """``torch.ops.dflash.block_attention``: see :func:`block_attention_reference`."""
    return block_attention_reference(q, context_k, context_v, block_k, block_v, scale, window, causal)


@block_attention.register_fake
def _block_attention_shape(q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                           scale: float, window: int, causal: int) -> Tensor:
    batch, heads, tokens, dim = q.shape
    return q.new_empty(batch, tokens, heads * dim)
