"""Training-mode forward of the drafter: many blocks in one pass over the clean context (docs/algorithm.md §4).

The network is ``DraftHead`` itself (``model/draft_head.py``): :meth:`DraftHead.forward_blocks` runs
the very layers the runtime serves, with keys arranged per block (context strictly before the
anchor, the block's own keys) by the one visibility rule of ``model/block_attention.py``. On one
block with ``a = start`` it is the inference forward's computation (tested).
"""

from __future__ import annotations

from torch import Tensor

from dflash_trt.model.draft_head import DraftHead


def draft_forward_blocks(head: DraftHead, block_embeds: Tensor, taps: Tensor, anchors: Tensor) -> Tensor:
    """Normed draft hidden states of every block slot (:meth:`DraftHead.forward_blocks`).

    Shapes: block_embeds ``[b, J, B, H]`` (anchor + masks, already scaled), taps ``[b, S, L*H]``
    (clean context features at positions ``0..S-1``), anchors ``[b, J]`` (every ``a_j >= 1``) -> ``[b, J, B, H]``.
    """
    return head.forward_blocks(block_embeds, taps, anchors)
