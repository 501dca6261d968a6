"""Pure acceptance math for one draft-verify cycle (docs/algorithm.md §3.3-3.4, docs/style.md R3).

Index convention: a block has slots ``0..K`` (slot 0 = anchor); draft slot ``k`` proposes the
token at ``start + k``; target row ``k`` predicts ``start + k + 1``, so draft slot ``k`` is
checked against target row ``k - 1``. Every function returns ``Verdict(accepted, bonus)``:
``accepted`` drafts (0..K) and the ``bonus`` token the target emits after them, so a cycle
commits ``accepted + 1`` tokens. Each reads back one small tensor (the host needs the count).

Glossary (vLLM RejectionSampler): *accepted* drafts are kept; the *bonus* is the target's own
token after the accepted prefix (a *recovered* token when it follows a rejection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_trt.runtime.sampling import argmax_ids, draw


@dataclass(frozen=True)
class Verdict:
    accepted: int
    bonus: int


def accept_greedy(drafts: Tensor, target_logits: Tensor) -> Verdict:
    """Greedy (T = 0): ``acc = Σ_{i=1..K} Π_{j<=i} 1[x_j = y_{j-1}]``, ``bonus = y_acc``, ``y = argmax``.

    Shapes: drafts ``[K]`` (x_1..x_K), target_logits ``[K+1, V]``.
    """
    targets = argmax_ids(target_logits)  # host-sync: the loop needs the count
    accepted = 0
    for draft, target in zip(drafts.tolist(), targets):
        if draft != target:
            break
        accepted += 1
    return Verdict(accepted, targets[accepted])


def accept_onehot(drafts: Tensor, target_probs: Tensor, generator: torch.Generator) -> Verdict:
    """Greedy proposals, one-hot rejection (§3.4 A): draw ``y_k ~ p_k`` for every row; accept slot ``k``
    iff ``x_k = y_{k-1}`` (probability ``p_{k-1}(x_k)``); ``bonus = y_acc``.

    After a rejection ``y_acc`` is a draw from ``p_acc`` conditioned on ``!= x_{acc+1}``, i.e.
    ``norm(max(p - onehot(x), 0))``: the standard residual for a one-hot proposal, so output ~ p.
    Shapes: drafts ``[K]``, target_probs ``[K+1, V]``.
    """
    samples = draw(target_probs, generator)
    accepted = int(torch.cumprod(drafts == samples[:-1], 0).sum())
    return Verdict(accepted, int(samples[accepted]))


def accept_rejection(drafts: Tensor, draft_probs: Tensor, target_probs: Tensor,
                     generator: torch.Generator) -> Verdict:
    """Sampled proposals, standard rejection (§3.4 B, arXiv 2211.17192): accept slot ``k`` iff
    ``u_k · q_k(x_k) < p_{k-1}(x_k)`` (probability ``min(1, p/q)``); stop at the first reject.
    Bonus: ``~ p_K`` if all accepted, else ``~ norm(max(p_acc - q_{acc+1}, 0))`` (``p_acc`` if that is 0).

    Shapes: drafts ``[K]``, draft_probs ``[K, V]`` (q_1..q_K), target_probs ``[K+1, V]`` (p_0..p_K).
    """
    num_drafts = drafts.shape[0]
    rows = torch.arange(num_drafts, device=drafts.device)
    q = draft_probs[rows, drafts]
    p = target_probs[rows, drafts]
    u = torch.rand(num_drafts, generator=generator, device=drafts.device)
    accepted = int(torch.cumprod(u * q < p, 0).sum())
    if accepted == num_drafts:
        return Verdict(accepted, int(draw(target_probs[-1:], generator)[0]))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[accepted]
    return Verdict(accepted, int(draw(residual.unsqueeze(0), generator)[0]))
