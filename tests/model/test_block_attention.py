"""The one visibility rule: its statement checked by brute force, and every mask built from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_trt.model.block_attention import block_mask, block_visibility, visible


def _sees(query: int, key: int, causal: bool, window: int) -> bool:
    """docs/algorithm.md §2.5 spelled out: causal -> key <= query; a window -> query - key < w, two-sided unless
    causal."""
    if causal and key > query:
        return False
    if window and query - key >= window:
        return False
    return not (window and not causal and key - query >= window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 1, 3, 7])
def test_rule_matches_its_statement_on_torch_and_numpy_positions(causal, window):
    queries, keys = range(12), range(15)
    expected = torch.tensor([[_sees(p, k, causal, window) for k in keys] for p in queries])
    got = visible(torch.arange(12).view(-1, 1), torch.arange(15).view(1, -1), causal, window)
    assert torch.equal(got, expected)
    got_numpy = visible(np.arange(12).reshape(-1, 1), np.arange(15).reshape(1, -1), causal, window)
    assert np.array_equal(got_numpy, expected.numpy())


def test_op_mask_is_none_only_for_full_bidirectional_layers():
    assert block_mask(5, 4, causal=False, window=0, device="cpu") is None
    mask = block_mask(5, 4, causal=True, window=0, device="cpu")[0, 0]  # [T, C+T]
    assert mask.shape == (4, 9)
    assert mask[0, :6].all() and not mask[0, 6:].any()  # query 0 sits at position 5
    assert mask[3].all()


def test_training_block_sees_context_before_its_anchor_and_its_own_block_only():
    visibility = block_visibility(torch.tensor([[2, 5]]), context_len=8, block_len=3, causal=True, window=3)
    assert visibility.shape == (1, 2, 3, 11)
    for j, anchor in enumerate((2, 5)):
        for t in range(3):
            query = anchor + t
            context = [k < anchor and _sees(query, k, True, 3) for k in range(8)]
            own = [_sees(query, anchor + s, True, 3) for s in range(3)]
            assert visibility[0, j, t].tolist() == context + own
