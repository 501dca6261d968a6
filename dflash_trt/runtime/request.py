"""What the runtime holds for one request between steps, and what a step commits for it (docs/algorithm.md §3.1).

Data only: the prefill (``runtime/prefill.py``) and the step (``runtime/step.py``) read and advance it, the
scheduler owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.sampling import is_greedy

Rule = Literal["greedy", "onehot", "rejection"]
"""How a request's drafts are proposed and verified: argmax and greedy acceptance (T = 0, §3.3); argmax proposals
and one-hot rejection (§3.4 A); sampled proposals and standard rejection (§3.4 B)."""


@dataclass(frozen=True)
class Cycle:
    """Tokens committed by one target forward. The prefill's single token has ``drafted == 0`` and ``prefill``."""

    tokens: list[int]
    drafted: int
    accepted: int
    prefill: bool = False
    stopped: bool = False
    finished: bool = False  # the request is complete after this cycle (stop token or length)


@dataclass(eq=False)
class RequestState:
    """One request between steps: committed tokens, the anchor, and context taps not yet drafted on.

    ``start`` is the position of the anchor (the last committed token, not yet in the target cache).
    ``pending`` holds taps ``[c, L*H]`` of committed positions ``start-c .. start-1`` that the draft
    cache has not seen; steps that skip drafting let it grow, and the next draft call injects it all.
    ``generator`` (on the backend's device) is the request's own: every random number it uses comes from it.
    """

    slot: int
    prompt_ids: list[int]
    params: SamplingParams
    block_len: int  # anchor + draft slots; 1 = plain decoding (set to 1 when the policy retires its drafter)
    stop_ids: frozenset[int]
    mask_token_id: int
    generator: torch.Generator
    max_length: int = field(init=False)  # prompt + max_new_tokens
    start: int = field(init=False)
    anchor: int = -1
    pending: list[Tensor] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        self.max_length = len(self.prompt_ids) + self.params.max_new_tokens
        self.start = len(self.prompt_ids)

    @property
    def rule(self) -> Rule:
        if is_greedy(self.params.temperature):
            return "greedy"
        return "onehot" if self.params.proposal == "greedy" else "rejection"

    @property
    def uses_drafter(self) -> bool:
        return self.block_len > 1

    @property
    def pending_context(self) -> int:
        """Committed positions whose taps the draft cache has not taken in yet."""
        return sum(taps.shape[0] for taps in self.pending)
