"""The soft-label objective: slot-weighted KL from the target's full distribution (training/soft_labels.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.training.objective import slot_weights, weighted_block_loss
from dflash_trt.training.soft_labels import soft_label_logits, weighted_block_kl


def test_soft_labels_of_slot_k_are_the_target_logits_after_the_true_prefix():
    target_logits = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)  # row p predicts position p + 1
    soft = soft_label_logits(target_logits, torch.tensor([2, 5]), block_len=4)
    assert soft.shape == (2, 3, 3)
    assert torch.equal(soft[0], target_logits[2:5]) and torch.equal(soft[1], target_logits[5:8])


def test_kl_is_zero_for_the_target_distribution_and_positive_otherwise():
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(5, 3, 11, generator=generator)
    valid = torch.ones(5, 3, dtype=torch.bool)
    weights = slot_weights(4)
    assert float(weighted_block_kl(target, target, valid, weights)) < 1e-6
    assert float(weighted_block_kl(target + 1.0, target, valid, weights)) < 1e-6  # a logit shift is the same q
    assert float(weighted_block_kl(torch.randn(5, 3, 11, generator=generator), target, valid, weights)) > 0.01


def test_kl_equals_the_soft_cross_entropy_minus_the_target_entropy():
    generator = torch.Generator().manual_seed(1)
    logits, target = torch.randn(4, 3, 7, generator=generator), torch.randn(4, 3, 7, generator=generator)
    valid = torch.tensor([[1, 1, 0]] * 4, dtype=torch.bool)
    weights = slot_weights(4, gamma=2.0)
    for temperature in (1.0, 0.7):
        p = F.softmax(target / temperature, -1)
        per_slot = -(p * F.log_softmax(logits / temperature, -1)).sum(-1) + (p * p.log()).sum(-1)  # [4, 3]
        w = weights.expand(4, 3) * valid
        expected = (per_slot * w).sum() / w.sum()
        found = weighted_block_kl(logits, target, valid, weights, temperature)
        assert torch.allclose(found, expected, atol=1e-6)


def test_with_one_hot_targets_the_kl_is_the_hard_label_cross_entropy():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 9, generator=generator)
    labels = torch.randint(0, 9, (3, 5), generator=generator)
    one_hot = F.one_hot(labels, 9).float() * 1e4  # softmax of these logits is one-hot in float32
    valid = torch.rand(3, 5, generator=generator) > 0.3
    weights = slot_weights(6)
    assert torch.allclose(weighted_block_kl(logits, one_hot, valid, weights),
                          weighted_block_loss(logits, labels, valid, weights), atol=1e-5)
