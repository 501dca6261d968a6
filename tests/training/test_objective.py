"""The DFlash training objective (docs/algorithm.md §4): anchors, block inputs and labels, the block mask, the loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.training.objective import (accepted_prefix, block_diagonal_mask, block_labels, block_token_ids,
                                           block_visibility, decay_gamma, sample_anchors, slot_weights,
                                           weighted_block_loss)


def test_block_diagonal_mask_matches_hand_computed_case():
    # context of 6 positions, two blocks of 3 at anchors 2 and 4
    mask = block_diagonal_mask(torch.tensor([2, 4]), context_len=6, block_len=3)
    expected = torch.tensor([
        # ctx 0..5                 block 0     block 1
        [1, 1, 0, 0, 0, 0,         1, 1, 1,    0, 0, 0],
        [1, 1, 0, 0, 0, 0,         1, 1, 1,    0, 0, 0],
        [1, 1, 0, 0, 0, 0,         1, 1, 1,    0, 0, 0],
        [1, 1, 1, 1, 0, 0,         0, 0, 0,    1, 1, 1],
        [1, 1, 1, 1, 0, 0,         0, 0, 0,    1, 1, 1],
        [1, 1, 1, 1, 0, 0,         0, 0, 0,    1, 1, 1],
    ]).bool()
    assert torch.equal(mask, expected)


def test_causal_block_mask_is_lower_triangular_inside_the_block():
    mask = block_diagonal_mask(torch.tensor([1]), context_len=3, block_len=3, causal=True)
    expected = torch.tensor([[1, 0, 0, 1, 0, 0],
                             [1, 0, 0, 1, 1, 0],
                             [1, 0, 0, 1, 1, 1]]).bool()
    assert torch.equal(mask, expected)


def test_sliding_window_limits_distance_from_the_query():
    visible = block_visibility(torch.tensor([4]), context_len=5, block_len=2, causal=True, window=3)
    # query positions 4 and 5; keys: context 0..4, block 4..5; visible iff key < anchor (or in-block causal)
    # and query - key < 3
    expected = torch.tensor([[[False, False, True, True, False, True, False],
                              [False, False, False, True, False, True, True]]])
    assert torch.equal(visible, expected)


def test_anchor_context_is_strictly_before_the_anchor():
    visible = block_visibility(torch.tensor([3, 7]), context_len=10, block_len=4)
    for row, anchor in enumerate((3, 7)):
        seen = visible[row, :, :10].nonzero()[:, 1].unique().tolist()
        assert seen == list(range(anchor))
    assert visible[:, :, 10:].all()  # own block: bidirectional


@pytest.mark.parametrize("block_len, gamma", [(16, 7.0), (8, 4.0), (4, 2.5), (32, 13.0)])
def test_slot_weights_decay_with_the_documented_gamma(block_len, gamma):
    assert decay_gamma(block_len) == gamma
    expected = [math.exp(-(k - 1) / gamma) for k in range(1, block_len)]
    assert torch.allclose(slot_weights(block_len), torch.tensor(expected))
    assert slot_weights(block_len)[0] == 1.0


def test_weighted_loss_equals_hand_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, 3], [4, 0, 1]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    weights = slot_weights(4, gamma=2.0)  # slots 1..3: 1, e^-0.5, e^-1
    num = den = 0.0
    for r in range(2):
        for k in range(3):
            if valid[r, k]:
                ce = -F.log_softmax(logits[r, k], -1)[labels[r, k]].item()
                num += weights[k].item() * ce
                den += weights[k].item()
    assert weighted_block_loss(logits, labels, valid, weights).item() == pytest.approx(num / den, rel=1e-6)


def test_anchors_are_sorted_distinct_and_leave_room_for_the_block():
    generator = torch.Generator().manual_seed(0)
    anchors = sample_anchors(length=40, block_len=16, max_anchors=512, generator=generator)
    assert anchors.tolist() == list(range(1, 25))  # every position 1..len-B when fewer than the cap
    few = sample_anchors(length=200, block_len=8, max_anchors=10, generator=generator)
    assert len(few) == 10 and len(set(few.tolist())) == 10
    assert torch.equal(few, few.sort().values) and few.min() >= 1 and few.max() <= 192
    assert sample_anchors(length=16, block_len=16, max_anchors=4, generator=generator).numel() == 0


def test_blocks_hold_the_anchor_then_masks_and_labels_follow_without_shift():
    tokens = torch.arange(100, 120)
    anchors = torch.tensor([2, 9])
    assert block_token_ids(tokens, anchors, 4, mask_token_id=0).tolist() == [[102, 0, 0, 0], [109, 0, 0, 0]]
    assert block_labels(tokens, anchors, 4).tolist() == [[103, 104, 105], [110, 111, 112]]


def test_accepted_prefix_counts_the_leading_matches_only():
    predictions = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    valid = torch.ones(3, 3, dtype=torch.bool)
    assert accepted_prefix(predictions, labels, valid).tolist() == [3, 1, 0]
