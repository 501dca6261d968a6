"""Pure acceptance math of one step, batched over its rows (docs/algorithm.md §3.3-3.4, docs/style.md R3).

Rows and slots. A step verifies ``R`` rows; row ``r`` drafted ``k_r >= 0`` tokens (its *count*; 0 is a plain
decoding step). In a row, block slot 0 is the anchor, draft ``j`` (1..k) proposes the token at ``start + j`` and
target row ``j`` (0..k) predicts ``start + j + 1``, so draft ``j`` is checked against target row ``j - 1``.

Flattened layout (as vLLM's ``RejectionSampler``): the drafts of every row are concatenated, ``drafts [N]`` with
``N = Σ k_r``, row ``r``'s at ``o_r .. o_r + k_r - 1`` (``o`` the exclusive prefix sum of the counts); the target
rows are concatenated the same way with ``k_r + 1`` per row, ``[N + R, ...]``, row ``r``'s at
``o_r + r .. o_r + r + k_r``. :class:`RowLayout` holds the counts and the index tensors that pad both to
``[R, K]`` / ``[R, K + 1]`` (``K = max k_r``).

Every rule returns :class:`Verdicts`: ``accepted [R]`` and ``tokens [R, K + 1]``; row ``r`` commits
``tokens[r, :accepted[r] + 1]``, its accepted drafts and then the *bonus*, the target's own token after them (a
*recovered* token when it follows a rejection). Nothing here reads a tensor back to the host and every shape is
known in advance: the step hands the verdicts over in one transfer. Random numbers come in as uniforms the caller
drew from each request's own generator, so a row's verdict depends on its own data and draws only.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from dflash_trt.model.transfer import to_device
from dflash_trt.runtime.sampling import draw


@dataclass(frozen=True)
class Verdicts:
    """``accepted [R]`` int64 drafts kept per row (None: no row drafted, so none accepted); ``tokens [R, K + 1]``
    int64, row ``r`` committing ``tokens[r, :accepted[r] + 1]`` (later columns are padding)."""

    accepted: Tensor | None
    tokens: Tensor


@dataclass(frozen=True)
class RowLayout:
    """Where each row's drafts and target rows sit in the flattened tensors, and how to pad them.

    ``draft_slots [R, K]`` indexes ``drafts`` with ``N`` (one past the end) for padding; ``target_slots [R, K+1]``
    indexes the target rows, padding repeating the row's last one; ``checked [N]`` is the target row each draft is
    checked against (its own index plus its row); ``draft_offsets``/``target_offsets`` are ``o_r`` and ``o_r + r``
    ``[R]``; ``counts_t`` is ``counts`` on the device.
    """

    counts: tuple[int, ...]
    draft_slots: Tensor
    target_slots: Tensor
    checked: Tensor
    draft_offsets: Tensor
    target_offsets: Tensor
    counts_t: Tensor

    @classmethod
    def of(cls, counts: list[int] | tuple[int, ...], device: torch.device | str) -> RowLayout:
        """Built on the host from the counts and moved to ``device`` in one host-to-device copy."""
        rows, width = len(counts), max(counts, default=0)
        offsets = [0, *accumulate(counts)][:-1]
        total = sum(counts)
        draft_slots = [o + j if j < k else total for o, k in zip(offsets, counts) for j in range(width)]
        target_slots = [o + r + min(j, k) for r, (o, k) in enumerate(zip(offsets, counts)) for j in range(width + 1)]
        checked = [o + r + j for r, (o, k) in enumerate(zip(offsets, counts)) for j in range(k)]
        flat = to_device(draft_slots + target_slots + checked + offsets + [o + r for r, o in enumerate(offsets)]
                         + list(counts), device)
        parts = flat.split([rows * width, rows * (width + 1), total, rows, rows, rows])
        return cls(tuple(counts), parts[0].view(rows, width), parts[1].view(rows, width + 1), *parts[2:])

    @property
    def width(self) -> int:
        """``K``: the most drafts of any row."""
        return max(self.counts, default=0)

    def pad_drafts(self, drafts: Tensor) -> Tensor:
        """``drafts [N]`` -> ``[R, K]``, padding -1 (never a token, so never a match)."""
        return torch.cat([drafts, drafts.new_full((1,), -1)])[self.draft_slots]


@dataclass(frozen=True)
class DraftProbs:
    """The draft distribution ``q`` of every draft slot, dense or sparse.

    Dense: ``probs [N, V]`` and ``support`` None. Sparse: ``probs [N, S]`` over the token ids ``support [N, S]``
    (zero elsewhere; ids may repeat, their masses add up), e.g. a drafter that proposes from its top ``S``.
    Rows need not sum to 1: every draw scales by the row's mass.
    """

    probs: Tensor
    support: Tensor | None = None

    def sample(self, uniforms: Tensor) -> Tensor:
        """``x ~ q`` per slot by inversion (``sampling.draw``). Shapes: uniforms ``[N]`` -> ids ``[N]``."""
        picked = draw(self.probs, uniforms)
        return picked if self.support is None else self.support.gather(1, picked.unsqueeze(1)).squeeze(1)

    def at(self, tokens: Tensor) -> Tensor:
        """``q_i(tokens_i)``. Shapes: tokens ``[N]`` -> ``[N]``."""
        if self.support is None:
            return self.probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return (self.probs * (self.support == tokens.unsqueeze(1))).sum(1)

    def dense(self, slots: Tensor, vocab: int) -> Tensor:
        """Rows ``slots`` as dense distributions over the vocabulary (zeros where there are no slots). Shapes:
        slots ``[R]`` -> ``[R, V]``."""
        if self.probs.shape[0] == 0:
            return self.probs.new_zeros(slots.shape[0], vocab)
        slots = slots.clamp(0, self.probs.shape[0] - 1)
        if self.support is None:
            return self.probs[slots]
        return self.probs.new_zeros(slots.shape[0], vocab).scatter_add_(1, self.support[slots], self.probs[slots])


def accept_matching(drafts: Tensor, choices: Tensor, layout: RowLayout) -> Verdicts:
    """Greedy (§3.3) and greedy proposals with one-hot rejection (§3.4 A): the target's choice ``y_j`` at every target
    row, then ``acc = Σ_{i=1..k} Π_{j<=i} 1[x_j = y_{j-1}]`` and the row commits ``y_0 .. y_acc``.

    Greedy: ``y = argmax`` of each target row; one-hot rejection: ``y_j ~ p_j`` (accepting ``x_j`` with probability
    ``p_{j-1}(x_j)``; after a rejection ``y_acc`` is a draw from ``p_acc`` given ``!= x_{acc+1}``, the residual
    ``norm(max(p - onehot(x), 0))``, so the output is distributed as ``p``).
    Shapes: drafts ``[N]``, choices ``[N + R]`` (flattened as the module says) -> ``Verdicts``.
    """
    choice_rows = choices[layout.target_slots]  # [R, K+1]
    match = layout.pad_drafts(drafts) == choice_rows[:, :-1]
    return Verdicts(match.cumprod(1).sum(1), choice_rows)


def accept_rejection(drafts: Tensor, draft_probs: DraftProbs, target_probs: Tensor, uniforms: Tensor,
                     bonus_uniforms: Tensor, layout: RowLayout) -> Verdicts:
    """Sampled proposals, standard rejection (§3.4 B, arXiv 2211.17192): accept draft ``j`` iff
    ``u_j · q_j(x_j) < p_{j-1}(x_j)`` (probability ``min(1, p/q)``), stopping at the first reject. Bonus: ``~ p_k``
    when all ``k`` are accepted, else ``~ norm(max(p_acc - q_{acc+1}, 0))`` (``p_acc`` when that has no mass); with a
    sparse ``q`` the residual differs from ``p_acc`` only on ``q``'s support.

    Shapes: drafts ``[N]``, draft_probs ``N`` slots (``DraftProbs``), target_probs ``[N + R, V]``, uniforms ``[N]``
    (one per draft), bonus_uniforms ``[R]`` -> ``Verdicts``.
    """
    kept = uniforms * draft_probs.at(drafts) < target_probs[layout.checked, drafts]
    kept = torch.cat([kept, kept.new_zeros(1)])[layout.draft_slots]  # [R, K], padding rejects
    accepted = kept.cumprod(1).sum(1)
    p_at = target_probs[layout.target_offsets + accepted]  # [R, V]
    rejected = draft_probs.dense(layout.draft_offsets + accepted, target_probs.shape[1])  # q_{acc+1}
    residual = (p_at - rejected).clamp_min(0)
    has_mass = residual.sum(1, keepdim=True) > 0
    all_kept = (accepted == layout.counts_t).unsqueeze(1)
    bonus = draw(torch.where(all_kept | ~has_mass, p_at, residual), bonus_uniforms)
    tokens = torch.cat([layout.pad_drafts(drafts), bonus.unsqueeze(1)], 1)
    return Verdicts(accepted, tokens.scatter(1, accepted.unsqueeze(1), bonus.unsqueeze(1)))
