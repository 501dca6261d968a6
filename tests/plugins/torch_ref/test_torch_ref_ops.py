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


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_layers_match_the_draft_heads_sliding_mask(causal):
    from dflash_trt.config import DraftConfig, RopeConfig
    from dflash_trt.model.draft_head import DraftHead
    from dflash_trt.plugins.torch_ref.ops import block_window_mask

    config = DraftConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                         rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0), vocab_size=32, max_position_embeddings=64,
                         num_target_layers=4, target_layer_ids=(1,), block_size=4, mask_token_id=0,
                         layer_sliding=(True,), sliding_window=3,
                         is_causal=None if causal else False)
    head = DraftHead(config)
    for start, tokens in [(0, 4), (6, 4), (9, 1)]:
        expected = head.sliding_mask(start, tokens, torch.device("cpu"))
        assert torch.equal(block_window_mask(start, tokens, 3, int(causal), torch.device("cpu")), expected)
