"""The ``Backend`` protocol: the two networks every backend executes, and nothing else (architecture.md §2).

The draft-verify loop, verification math, sampling and stats live once in ``runtime/`` and drive
any backend. A backend serves rows of several requests at once through ``target_batch`` /
``draft_batch``, each request in its own cache *slot*; ``max_batch`` says how many slots it has.
A backend with only the batch-1 methods (``target``/``draft``/``crop_target`` on slot 0) is
wrapped by :class:`SingleSlot` and serves one request at a time. Backends register by name in
``dflash_trt.plugins.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from dflash_trt.config import DraftConfig, TargetConfig


@dataclass(frozen=True)
class TargetRow:
    """One request's tokens in a target forward: ``tokens`` at positions ``start ..`` of cache ``slot``."""

    slot: int
    tokens: list[int]
    start: int
    last_only: bool = False  # prefill: only the last row's logits are needed


@dataclass(frozen=True)
class DraftRow:
    """One request's draft call: ``block`` (anchor + masks) at ``start ..`` and the new context taps
    ``[c, L*H]`` of positions ``start-c .. start-1`` (not yet in the draft cache of ``slot``)."""

    slot: int
    block: list[int]
    taps: Tensor
    start: int


class Backend(Protocol):
    """Batch-1 interface (cache slot 0). ``SingleSlot`` lifts it to the batched one."""

    target_config: TargetConfig
    draft_config: DraftConfig | None

    def reset(self) -> None:
        """Start a new request: both caches empty (buffers are reused)."""

    def target(self, tokens: Tensor, start: int, with_taps: bool, last_only: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """Target forward over ``tokens [1, T]`` at positions ``start..``; the KV cache keeps rows ``< start+T``.

        Returns logits ``[T, V]`` (``[1, V]`` with ``last_only``) and taps ``[T, L*H]`` when ``with_taps``.
        """

    def draft(self, block: Tensor, taps: Tensor, start: int) -> Tensor:
        """Draft forward: block ``[1, Bc]`` (anchor + masks) and new context taps ``[c, L*H]`` at
        positions ``start-c..start-1``. Returns draft logits ``[Bc-1, V]``; the draft cache holds ``< start``."""

    def crop_target(self, length: int) -> None:
        """Discard target cache rows ``>= length`` (rejected drafts)."""


class BatchedBackend(Protocol):
    """What the scheduler drives: rows of many requests per forward, one cache slot per request."""

    target_config: TargetConfig
    draft_config: DraftConfig | None
    max_batch: int

    def reset_slot(self, slot: int) -> None: ...

    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        """Per row: logits ``[T_i, V]`` (row k predicts position start+k+1) and taps ``[T_i, L*H]`` or None."""

    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        """Per row: draft logits ``[Bc_i - 1, V]``; afterwards each slot's draft cache holds positions ``< start``."""

    def crop_target_slot(self, slot: int, length: int) -> None: ...


class SingleSlot:
    """Adapts a batch-1 ``Backend`` to ``BatchedBackend`` with one slot (requests run one at a time)."""

    max_batch = 1

    def __init__(self, backend: Backend) -> None:
        self.inner = backend
        self.target_config = backend.target_config
        self.draft_config = backend.draft_config
        self.name = getattr(backend, "name", type(backend).__name__)

    def reset_slot(self, slot: int) -> None:
        self.inner.reset()

    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        import torch

        (row,) = rows
        return [self.inner.target(torch.tensor([row.tokens]), row.start, with_taps, row.last_only)]

    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        import torch

        (row,) = rows
        return [self.inner.draft(torch.tensor([row.block]), row.taps, row.start)]

    def crop_target_slot(self, slot: int, length: int) -> None:
        self.inner.crop_target(length)


def as_batched(backend) -> BatchedBackend:
    """The backend itself when it batches, else a one-slot adapter."""
    return backend if hasattr(backend, "target_batch") else SingleSlot(backend)
