"""DFlash2's candidate loss: teach the candidate selector to pick the label along the teacher-forced path (§4).

A DFlash2 drafter proposes the path its candidate selector walks (docs/algorithm.md §2.11): at slot ``k``
the ``top_k`` best tokens of the draft logits are scored ``logit_k(c) + P[prev] · W(h_k) · S[c]`` and the
best one is taken. Training feeds the selector the path it should have walked: ``prev`` is the label of
slot ``k - 1`` (the anchor token for slot 1), never the drafter's own choice. That is exact for greedy
acceptance, because slot ``k`` can only be accepted when slots ``1 .. k-1`` equalled their labels, and
then the walk's ``prev`` *is* the previous label. The loss of slot ``k`` is the cross-entropy of the label
over the ``top_k`` candidate scores,

    ``CE^sel_k = -log softmax(score_k)[label_k]``    when ``label_k`` is among slot k's candidates,

and the slot contributes nothing when it is not: the selector cannot choose a token outside its
candidates, so there is nothing to teach it there; the DFlash cross-entropy on the full logits (which the
DFlash2 objective keeps) is what lifts such a label into the top-k. The block loss uses the DFlash slot
weights and the DFlash denominator (every valid slot, hit or not), so a drafter whose labels all fall
outside the candidates gets no selector loss rather than a large one:

    ``L_sel = Σ_k w_k · 1[label_k ∈ cand_k] · CE^sel_k / Σ_k w_k``.

Gradients reach the codebooks and the hidden projection, and also the logits of the candidates (the
unary term) and through them the whole drafter. All functions here are pure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.model.candidate_selector import CandidateSelector


def teacher_forced_scores(selector: CandidateSelector, hidden: Tensor, logits: Tensor, previous: Tensor
                          ) -> tuple[Tensor, Tensor]:
    """Every slot's candidate scores given the *labelled* predecessor (module docstring).

    Shapes: hidden ``[R, K, H]`` (normed draft hidden of slots 1..K), logits ``[R, K, V]`` (after the output
    multiplier and soft-cap), previous ``[R, K]`` (the anchor, then labels 1..K-1) -> (scores ``[R, K, k]``,
    candidate ids ``[R, K, k]``, best logit first).
    """
    unary, candidates = selector.candidates(logits)
    query = selector.predecessor_codebook(previous) * selector.hidden_projection(hidden)  # [R, K, rank]
    pairwise = (selector.successor_codebook(candidates) @ query.unsqueeze(-1)).squeeze(-1)  # [R, K, k]
    return unary + pairwise, candidates


def weighted_candidate_loss(scores: Tensor, candidates: Tensor, labels: Tensor, valid: Tensor, weights: Tensor
                            ) -> Tensor:
    """``Σ_k w_k · 1[label ∈ cand] · CE^sel_k / Σ_k w_k`` over valid slots (module docstring).

    Shapes: scores, candidates ``[R, K, k]``, labels, valid ``[R, K]`` (bool), weights ``[K]`` -> scalar.
    """
    hits = candidates == labels.unsqueeze(-1)  # [R, K, k]; at most one hit per slot (top-k ids are distinct)
    found = hits.any(dim=-1) & valid
    log_q = F.log_softmax(scores.float(), dim=-1)
    ce = -(log_q * hits).sum(dim=-1)  # 0 where the label is not a candidate (masked below anyway)
    w = weights.to(ce.device).expand_as(ce)
    return (ce * w * found).sum() / (w * valid).sum().clamp_min(1e-12)


def selector_predictions(scores: Tensor, candidates: Tensor) -> Tensor:
    """The greedy choice of every slot on the teacher-forced path (the best score, first of equal ones).

    Along the accepted prefix this is the token the greedy walk proposes (its ``prev`` equals the label there),
    so the accepted prefix of these predictions is the greedy walk's. Shapes: ``[R, K, k]`` -> ``[R, K]``.
    """
    return candidates.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)


def candidate_coverage(candidates: Tensor, labels: Tensor, valid: Tensor) -> tuple[int, int]:
    """(valid slots whose label is among their candidates, valid slots): how often the selector can be right.

    Shapes: candidates ``[R, K, k]``, labels, valid ``[R, K]``."""
    found = (candidates == labels.unsqueeze(-1)).any(dim=-1) & valid
    return int(found.sum()), int(valid.sum())  # host-sync: metrics of the step


def previous_tokens(anchor_ids: Tensor, labels: Tensor) -> Tensor:
    """The teacher-forced predecessors ``[anchor, label_1 .. label_{K-1}]``. Shapes: anchor_ids ``[...]``,
    labels ``[..., K]`` -> ``[..., K]``."""
    return torch.cat([anchor_ids.unsqueeze(-1), labels[..., :-1]], dim=-1)
