"""Training-mode forward of ``DraftHead``: many blocks in one pass, each with its explicit mask (dflash.md §4).

It runs the very modules of :class:`~dflash_trt.model.draft_head.DraftHead` (``fc``, ``hidden_norm``,
each layer's norms, projections, QK-norm, MLP, ``norm``), so the weights trained here are the
weights served. The difference from the inference forward is only where the keys come from:
at inference the cache holds the context rows ``< start`` and the block attends to all of them;
here the whole clean sequence's context K/V is computed once and each block sees the
positions ``< a_j`` through :func:`~dflash_trt.training.objective.block_visibility`. On one
block with ``a = start`` the two are the same computation (tested).

Blocks are laid out ``[batch, J, B]`` and flattened to ``batch*J`` attention rows, each with keys
``[context (S) ; own block (B)]``: the non-zero tiles of the dense block-diagonal mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.layers import apply_rope, attend
from dflash_trt.training.objective import block_visibility


def draft_forward_blocks(head: DraftHead, block_embeds: Tensor, taps: Tensor, anchors: Tensor) -> Tensor:
    """Normed draft hidden states of every block slot.

    Shapes: block_embeds ``[b, J, B, H]`` (anchor + masks, already scaled), taps ``[b, S, L*H]``
    (clean context features at positions ``0..S-1``), anchors ``[b, J]`` (block ``j`` sits at
    ``a_j .. a_j+B-1``; every ``a_j >= 1``) -> ``[b, J, B, H]``.
    """
    cfg = head.config
    batch, count, block_len, hidden = block_embeds.shape
    context_len = taps.shape[1]
    rows = batch * count
    ctx = head.hidden_norm(head.fc(taps))  # [b, S, H]
    context_pos = torch.arange(context_len, device=taps.device).expand(batch, -1)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(block_len, device=taps.device)).view(rows, block_len)
    cos_c, sin_c = head.rotary.lookup(context_pos, ctx.dtype)  # [b, 1, S, d]
    cos_b, sin_b = head.rotary.lookup(block_pos, ctx.dtype)  # [b*J, 1, B, d]
    masks = {}
    for causal, sliding in head.mask_kinds:
        visible = block_visibility(anchors.cpu(), context_len, block_len, causal=causal,
                                   window=cfg.sliding_window if sliding else None)
        masks[(causal, sliding)] = visible.view(rows, 1, block_len, context_len + block_len).to(taps.device)
    h = block_embeds.reshape(rows, block_len, hidden)
    for layer in head.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)  # the context is not passed through input_layernorm (§2.4)
        q = attn.q_norm(attn.q_proj(x).view(rows, block_len, attn.num_heads, attn.head_dim))
        q = apply_rope(q.transpose(1, 2), cos_b, sin_b)  # [b*J, nq, B, d]
        k_ctx, v_ctx = attn.project_kv(ctx, cos_c, sin_c)  # [b, nkv, S, d]
        k_blk, v_blk = attn.project_kv(x, cos_b, sin_b)  # [b*J, nkv, B, d]
        keys = torch.cat([k_ctx.repeat_interleave(count, dim=0), k_blk], dim=2)  # [b*J, nkv, S+B, d]
        values = torch.cat([v_ctx.repeat_interleave(count, dim=0), v_blk], dim=2)
        h = h + attn.o_proj(attend(q, keys, values, masks[attn.mask_kind]))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.norm(h).view(batch, count, block_len, hidden)
