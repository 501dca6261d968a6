"""The ``Backend`` protocol: the two networks every backend executes, and nothing else (architecture.md §2).

The draft-verify loop, verification math, sampling and stats live once in ``runtime/`` and
drive any backend through these five methods. Backends register by name in
``dflash_trt.plugins.registry``.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from dflash_trt.config import DraftConfig, TargetConfig


class Backend(Protocol):
    """One target and an optional drafter with their static caches (batch 1 rows for now)."""

    target_config: TargetConfig
    draft_config: DraftConfig | None

    def reset(self) -> None:
        """Start a new request: both caches empty (buffers are reused)."""

    def target(self, tokens: Tensor, start: int, with_taps: bool, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """Target forward over ``tokens [1, T]`` at positions ``start..``; the KV cache keeps rows ``< start+T``.

        Returns logits ``[T, V]`` (``[1, V]`` with ``last_only``) and taps ``[T, L*H]`` when ``with_taps``.
        """

    def draft(self, block: Tensor, taps: Tensor, start: int) -> Tensor:
        """Draft forward: block ``[1, Bc]`` (anchor + masks) and new context taps ``[c, L*H]`` at
        positions ``start-c..start-1``. Returns draft logits ``[Bc-1, V]``; the draft cache holds ``< start``."""

    def crop_target(self, length: int) -> None:
        """Discard target cache rows ``>= length`` (rejected drafts)."""
