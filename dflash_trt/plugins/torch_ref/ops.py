"""The torch binding of every ``plugins/schema.py`` op, as ``torch.library`` ops ``dflash::…``.

The math is the model's (``model/block_attention.py``): ``block_attention_reference`` is what every
other implementation is held to (parity tests in ``tests/plugins``). Importing this module registers
``torch.ops.dflash.block_attention`` (the ONNX exporter needs a registered op to emit a plugin node);
nothing else happens at import.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.model.block_attention import block_attention as block_attention_reference
from dflash_trt.plugins.schema import BLOCK_ATTENTION


@torch.library.custom_op(BLOCK_ATTENTION.qualified_name, mutates_args=())
def block_attention(q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                    scale: float, window: int, causal: int) -> Tensor:
    """``torch.ops.dflash.block_attention``: see :func:`~dflash_trt.model.block_attention.block_attention`."""
    return block_attention_reference(q, context_k, context_v, block_k, block_v, scale, window, causal)


@block_attention.register_fake
def _block_attention_shape(q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                           scale: float, window: int, causal: int) -> Tensor:
    batch, heads, tokens, dim = q.shape
    return q.new_empty(batch, tokens, heads * dim)
