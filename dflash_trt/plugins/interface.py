"""The ``Backend`` protocol: the two networks every backend executes, and nothing else (docs/design.md).

The draft-verify loop, verification math, sampling and stats live once in ``runtime/`` and drive
any backend. A backend serves rows of several requests per forward through ``target_batch`` /
``draft_batch``, each request in its own cache *slot*; a request alone is a one-row batch. It declares
``max_batch`` (its slots), the ``device`` it computes in, where the logits and taps it returns live, and the
``dtype`` of its activations and caches. Backends register with their capabilities in
``dflash_trt.plugins.registry``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from dflash_trt.config import DraftConfig, TargetConfig


@dataclass(frozen=True)
class TargetRow:
    """One request's tokens in a target forward: ``tokens`` at positions ``start ..`` of cache ``slot``.

    A prompt's tokens are a host list; a verify row's (the anchor and its drafts) are an int64 tensor ``[T]`` on the
    backend's device, built there without reading the drafts back. :func:`host_tokens` gives a host list of either.
    """

    slot: int
    tokens: list[int] | Tensor
    start: int
    last_only: bool = False  # prefill: only the last row's logits are needed

    @property
    def width(self) -> int:
        """``len(tokens)`` (a tensor's without ``Tensor.__len__``, which costs microseconds of Python)."""
        return self.tokens.shape[0] if isinstance(self.tokens, Tensor) else len(self.tokens)


def host_tokens(rows: list[TargetRow]) -> list[TargetRow]:
    """``rows`` with every tensor of tokens as a host list, for backends whose inputs are host arrays (one read of
    each tensor: a device sync where the tensor lives on a GPU)."""
    return [row if isinstance(row.tokens, list) else replace(row, tokens=row.tokens.tolist()) for row in rows]


@dataclass(frozen=True)
class DraftRow:
    """One request's draft call: ``block`` (anchor + masks) at ``start ..`` and the new context taps
    ``[c, L*H]`` of positions ``start-c .. start-1`` (not yet in the draft cache of ``slot``)."""

    slot: int
    block: list[int]
    taps: Tensor
    start: int
    # DFlash2 only (``propose_batch``): the walk's temperature (0: the best path) and, when > 0, one uniform in
    # [0, 1) per draft slot ``[Bc - 1]``, drawn from the request's own generator (docs/algorithm.md §2.11)
    temperature: float = 0.0
    uniforms: Tensor | None = None


INTAKE_BLOCKS = 2
"""A drafting row whose new context is longer than this many blocks (a request's first draft takes in its whole
prompt) drafts in a call of its own when other rows draft in the same step: one call pads every row's context to the
longest, so each of them would take in a prompt's worth of padding (``intake_groups``)."""


def intake_groups(rows: list[DraftRow]) -> list[list[int]]:
    """The draft calls a step's drafting rows make, as lists of row indices: one call, or two where some rows take in
    more than ``INTAKE_BLOCKS`` blocks of new context and others do not (those rows first, then the rest)."""
    block = max(len(r.block) for r in rows)
    intake = [i for i, r in enumerate(rows) if r.taps.shape[0] > INTAKE_BLOCKS * block]
    if not intake or len(intake) == len(rows):
        return [list(range(len(rows)))]
    taking = set(intake)
    return [intake, [i for i in range(len(rows)) if i not in taking]]


def by_intake(rows: list[DraftRow], call: Callable[[list[DraftRow]], list]) -> list:
    """``call(rows)``, made once per :func:`intake_groups` group; its per-row results in the order of ``rows``."""
    groups = intake_groups(rows)
    if len(groups) == 1:
        return call(rows)
    results: list = [None] * len(rows)
    for group in groups:
        for index, result in zip(group, call([rows[i] for i in group])):
            results[index] = result
    return results


@dataclass(frozen=True)
class DraftProposal:
    """A DFlash2 drafter's proposals for one row: the selector's path and the sparse distribution it came from.

    Shapes: tokens ``[K]`` (int64, slots 1..K); support ``[K, k]`` (int64 candidate ids, best logit first); probs
    ``[K, k]`` float32 ``softmax(score / T)`` over the support when the row was sampled (T > 0), else None.
    """

    tokens: Tensor
    support: Tensor
    probs: Tensor | None = None


class Backend(Protocol):
    """What the scheduler drives: rows of many requests per forward, one cache slot per request. A backend whose
    batched target forward runs its requests one after the other also sets ``rows_in_turn = True`` (the torch
    backend in half precision, whose target runs in frames: ``model/frames.py``); a session says so at start-up."""

    name: str
    target_config: TargetConfig
    draft_config: DraftConfig | None
    max_batch: int  # cache slots: requests that can be in flight at once
    device: str  # where the networks run and returned logits/taps live ("cpu", "cuda:0"); generators live there
    dtype: torch.dtype  # activation/cache dtype of the networks

    def reset_slot(self, slot: int) -> None:
        """Start a new request in ``slot``: both of its caches empty (buffers are reused)."""

    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        """Per row: logits ``[T_i, V]`` (``[1, V]`` with ``last_only``; row k predicts position start+k+1)
        and taps ``[T_i, L*H]`` or None. Each slot's target cache then holds positions ``< start + T_i``."""

    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        """Per row: draft logits ``[Bc_i - 1, V]``; afterwards each slot's draft cache holds positions ``< start``."""

    def propose_batch(self, rows: list[DraftRow]) -> list[DraftProposal]:
        """DFlash2 drafters (``draft_config.architecture == "dflash2"``): the draft call of ``draft_batch``, then the
        candidate selector's walk per row (greedy, or sampled with the row's temperature and uniforms). Backends
        that cannot run a DFlash2 drafter leave it out; their loaders refuse such a drafter."""

    def crop_target_slot(self, slot: int, length: int) -> None:
        """Discard target cache rows ``>= length`` of ``slot`` (rejected drafts)."""
