"""Distillation to the target's full next-token distribution: soft labels, the decayed block KL (docs/algorithm.md §4).

The hard-label objective (``objective.weighted_block_loss``) teaches the drafter the target's argmax,
which is all greedy serving checks. Sampled serving accepts a draft with probability ``p(x)``
(greedy proposals, one-hot rejection) or ``Σ min(p, q)`` (sampled proposals, arXiv 2211.17192), so
there the whole distribution matters. This module supplies the soft labels: slot ``k`` of block
``j`` is taught ``p_T(· | ids[:a_j + k]) = softmax(z / T)``, the target's logits ``z`` after the true
prefix at temperature ``T``, and the loss is the slot-weighted forward KL

    ``L = Σ_k w_k · KL(p_T,k ‖ q_T,k) / Σ_k w_k``,   ``q_T = softmax(draft_logits / T)``

(DistillSpec, arXiv 2310.08461, uses the same divergence). Forward KL is the soft-label cross-entropy
minus the target's entropy, a constant, so its minimiser is the hard-label one when ``p`` is one-hot;
it is reported as KL so that 0 means a perfect match. The loss is not rescaled by ``T²``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def soft_label_logits(target_logits: Tensor, anchors: Tensor, block_len: int) -> Tensor:
    """Target logits that slots 1..B-1 of each block are distilled towards: row ``a_j + k - 1`` predicts
    position ``a_j + k``. Shapes: target_logits ``[S, V]``, anchors ``[J]`` -> ``[J, B-1, V]``."""
    offsets = torch.arange(block_len - 1, device=anchors.device)  # k - 1 for k = 1..B-1
    return target_logits[anchors.unsqueeze(1) + offsets]


def weighted_block_kl(logits: Tensor, target_logits: Tensor, valid: Tensor, weights: Tensor,
                      temperature: float = 1.0) -> Tensor:
    """``Σ w_k · KL(softmax(z/T) ‖ softmax(logits/T)) / Σ w_k`` over valid slots (module docstring).

    Shapes: logits, target_logits ``[R, B-1, V]``, valid ``[R, B-1]`` bool, weights ``[B-1]`` -> scalar.
    """
    log_q = F.log_softmax(logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [R, B-1]
    w = weights.to(kl.device).expand_as(kl) * valid
    return (kl * w).sum() / w.sum().clamp_min(1e-12)
