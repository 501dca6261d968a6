"""torch.library op dflash::block_attention == its reference == the draft head's own attention."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.model.layers import attend
from dflash_trt.plugins.torch_ref.ops import block_attention_reference


def _inputs(batch, heads, kv_heads, tokens, context, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, generator=g)
    ck, cv = (torch.randn(batch, kv_heads, context, dim, generator=g) for _ in range(2))
    bk, bv = (torch.randn(batch, kv_heads, tokens, dim, generator=g) for _ in range(2))
    return q, ck, cv, bk, bv


@pytest.mark.parametrize("window,causal", [(0, 0), (3, 1), (5, 0)])
def test_registered_op_equals_reference(window, causal):
    args = _inputs(2, 4, 2, 5, 7)
    expected = block_attention_reference(*args, 0.0, window, causal)
    assert torch.equal(torch.ops.dflash.block_attention(*args, 0.0, window, causal), expected)


def test_full_layers_match_the_draft_heads_unmasked_attention():
    q, ck, cv, bk, bv = _inputs(1, 8, 4, 4, 9)
    expected = attend(q, torch.cat([ck, bk], 2), torch.cat([cv, bv], 2), None)
    assert torch.equal(block_attention_reference(q, ck, cv, bk, bv, 8 ** -0.5, 0, 0), expected)


def _head(sliding: bool, causal: bool | None):
    from dflash_trt.config import DraftConfig, RopeConfig
    from dflash_trt.model.draft_head import DraftHead

    config = DraftConfig(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                         rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0), vocab_size=32, max_position_embeddings=64,
                         num_target_layers=4, target_layer_ids=(1,), block_size=4, mask_token_id=0,
                         layer_sliding=(sliding, False), sliding_window=3 if sliding else None, is_causal=causal)
    head = DraftHead(config).eval()
    with torch.no_grad():  # non-trivial norms, so a norm applied in the wrong place shows
        for param in head.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(5))
    return head


@pytest.mark.parametrize("sliding,causal", [(False, None), (True, None), (True, False), (False, True)])
@torch.no_grad()
def test_draft_head_traced_through_the_registered_op_equals_its_serving_forward(sliding, causal):
    """``DraftHead.forward_op`` (the graph form an exporter traces) == ``DraftHead.forward`` over a KV cache."""
    head = _head(sliding, causal)
    g = torch.Generator().manual_seed(2)
    first, second = torch.randn(2, 5, 16, generator=g), torch.randn(2, 3, 16, generator=g)  # taps of two calls
    blocks = torch.randn(2, 2, 4, 16, generator=g)
    cache = head.new_cache(2, 32)
    served = [head(blocks[0], first, 5, cache)]
    cache.crop(5, 2)
    served.append(head(blocks[1], second, 8, cache))
    op = torch.ops.dflash.block_attention
    empty = torch.zeros(2, 2, 1, 0, 8)  # [n, B, nkv, P=0, d]
    hidden, keys, values = head.forward_op(blocks[0], first, torch.arange(0, 9).expand(2, -1), empty, empty, op)
    assert torch.allclose(hidden, served[0], atol=1e-6, rtol=0)
    hidden, _, _ = head.forward_op(blocks[1], second, torch.arange(5, 12).expand(2, -1), keys, values, op)
    assert torch.allclose(hidden, served[1], atol=1e-6, rtol=0)
    assert torch.equal(keys, cache.keys[:, :2, :, :5])  # the context rows the graph returns are the cached ones
