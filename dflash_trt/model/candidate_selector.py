"""DFlash2's candidate selector: the block's proposals as one path through per-slot candidates (§2.11).

A DFlash drafter proposes the argmax of each block slot independently. A DFlash2 drafter keeps the
``k`` best tokens of each slot's logits as candidates and walks the slots in order from the block's
anchor, scoring each candidate by its logit plus a low-rank pairwise term with the token chosen at
the slot before:

    score_i(c) = logit_i(c) + Σ_r P[prev, r] · W_h(hidden_i)[r] · S[c, r]

where ``P`` and ``S`` are the predecessor and successor codebooks (``V x rank``), ``W_h`` the hidden
projection (``H -> rank``) and ``prev`` the anchor for slot 1, else the token chosen at slot ``i - 1``.
Greedy decoding takes the best-scoring candidate at each step; sampling draws from
``softmax(score / T)`` over the ``k`` candidates, which is then the proposal distribution ``q`` the
rejection step uses (support = the candidate ids; docs/algorithm.md §3.4 C).

Tensor names follow the reference (``dflash`` 0.1.0, ``CandidateSelector``); the code here is ours.
Which candidate is chosen is a :data:`Chooser`, so one walk serves greedy, sampled (each request
drawing from its own generator) and replayed paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dflash_trt.config import DraftConfig

_TINY = 1e-30  # stands in for a row's zero temperature in a division whose result that row never uses
Chooser = Callable[[int, Tensor, Tensor], Tensor]
"""``(slot, scores [B, k], candidate ids [B, k]) -> chosen index [B]`` (long, into the k candidates)."""


@dataclass(frozen=True)
class SelectorWalk:
    """One walk over a batch of blocks.

    Shapes: tokens ``[B, K]`` (the proposals of slots 1..K), candidates ``[B, K, k]`` (token ids, best logit
    first), scores ``[B, K, k]`` (each candidate's score given the token chosen at the slot before).
    """

    tokens: Tensor
    candidates: Tensor
    scores: Tensor

    def probabilities(self, temperature: float | Tensor) -> Tensor:
        """The proposal distribution over the candidates, ``softmax(scores / T)`` in float32: ``[B, K, k]``
        (``temperature``: a float, or one per row ``[B]``, each > 0)."""
        temperatures = torch.as_tensor(temperature, dtype=torch.float32, device=self.scores.device)
        return torch.softmax(self.scores.float() / temperatures.reshape(-1, 1, 1), dim=-1)


def greedy_choice(slot: int, scores: Tensor, candidates: Tensor) -> Tensor:
    """The best-scoring candidate (the first of equal ones)."""
    return scores.argmax(dim=-1)


def sampled_choice(temperature: float | Tensor, uniforms: Tensor) -> Chooser:
    """A draw from ``softmax(scores / T)`` per row by inversion of ``uniforms [B, K]`` (one per row and slot, each row's
    from its request's own generator, so a draw depends on nothing else in the batch): the first candidate whose
    cumulative probability exceeds ``u``. ``temperature`` is one float or one per row ``[B]``; a row at 0 takes the
    best candidate (greedy rows can share a walk with sampled ones)."""
    temperatures = torch.as_tensor(temperature, dtype=torch.float32, device=uniforms.device).expand(uniforms.shape[0])

    def choose(slot: int, scores: Tensor, candidates: Tensor) -> Tensor:
        scaled = scores.float() / temperatures.clamp_min(_TINY).unsqueeze(-1)
        cdf = torch.softmax(scaled, dim=-1).cumsum(-1)  # [B, k]
        below = cdf <= uniforms[:, slot, None].to(cdf.dtype) * cdf[:, -1:]
        drawn = below.sum(-1).clamp_(max=scores.shape[-1] - 1)
        return torch.where(temperatures > 0, drawn, scores.argmax(dim=-1))

    return choose


def replayed_choice(tokens: Tensor) -> Chooser:
    """Follow a given path ``tokens [B, K]`` (each token must be among its slot's candidates)."""

    def choose(slot: int, scores: Tensor, candidates: Tensor) -> Tensor:
        hits = candidates == tokens[:, slot, None]
        if not bool(hits.any(dim=-1).all()):
            raise ValueError(f"slot {slot}: token(s) {tokens[:, slot].tolist()} are not among the candidates")
        return hits.int().argmax(dim=-1)

    return choose


class CandidateSelector(nn.Module):
    """``predecessor_codebook``, ``successor_codebook`` (``[V, rank]`` each) and ``hidden_projection`` (H -> rank)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        if cfg.selector_rank is None or cfg.selector_top_k is None:
            raise ValueError("a candidate selector needs a DFlash2 config (selector_rank, selector_top_k)")
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The ``k`` best tokens of every slot, best first. Shapes: logits ``[B, K, V]`` -> (values, ids)
        ``[B, K, k]``."""
        return torch.topk(logits, self.top_k, dim=-1)

    def walk(self, hidden: Tensor, logits: Tensor, anchors: Tensor, choose: Chooser = greedy_choice) -> SelectorWalk:
        """Walk slots 1..K from the anchors, choosing one candidate per slot.

        Shapes: hidden ``[B, K, H]`` (normed draft hidden of slots 1..K), logits ``[B, K, V]`` (after the
        output multiplier and soft-cap), anchors ``[B]`` (long) -> :class:`SelectorWalk`.
        """
        unary, candidates = self.candidates(logits)
        if hidden.shape[1] == 0:  # a one-token block proposes nothing
            return SelectorWalk(candidates[..., 0], candidates, unary)
        projected = self.hidden_projection(hidden)  # [B, K, rank]
        successors = self.successor_codebook(candidates)  # [B, K, k, rank]
        previous = anchors
        tokens, scores = [], []
        for slot in range(hidden.shape[1]):
            query = self.predecessor_codebook(previous) * projected[:, slot]  # [B, rank]
            score = unary[:, slot] + (successors[:, slot] @ query.unsqueeze(-1)).squeeze(-1)  # [B, k]
            index = choose(slot, score, candidates[:, slot])
            previous = candidates[:, slot].gather(-1, index.unsqueeze(-1)).squeeze(-1)
            tokens.append(previous)
            scores.append(score)
        return SelectorWalk(torch.stack(tokens, dim=1), candidates, torch.stack(scores, dim=1))
