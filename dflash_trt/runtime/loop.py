"""The draft-verify loop of one request (docs/algorithm.md §3.2; parity target: ``dflash_generate`` 0.1.0).

``RequestState`` holds one request's state and performs each step of a cycle; the scheduler runs
the forwards of many requests together (a request alone is a one-row batch). A cycle with
``draft_len == 0`` runs no drafter: plain autoregressive decoding through the same code, so a
speed-up measured against it cannot come from harness differences. Timing and stats belong to
the caller (docs/style.md R11).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_trt.config import SamplingParams
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.runtime.sampling import argmax_rows, draw, is_greedy, sampling_probs
from dflash_trt.runtime.verify import Verdict, accept_greedy, accept_onehot, accept_rejection


@dataclass(frozen=True)
class Cycle:
    """Tokens committed by one target forward. The prefill's single token has ``drafted == 0`` and ``prefill``."""

    tokens: list[int]
    drafted: int
    accepted: int
    prefill: bool = False
    stopped: bool = False
    finished: bool = False  # the request is complete after this cycle (stop token or length)


class RequestState:
    """One request between forwards: committed tokens, the anchor, and context taps not yet drafted on.

    ``start`` is the position of the anchor (the last committed token, not yet in the target cache).
    ``pending`` holds taps ``[c, L*H]`` of committed positions ``start-c .. start-1`` that the draft
    cache has not seen; cycles that skip drafting let it grow, and the next draft call injects it all.
    """

    def __init__(self, slot: int, prompt_ids: list[int], params: SamplingParams, block_len: int,
                 stop_ids: frozenset[int], mask_token_id: int, generator: torch.Generator) -> None:
        self.slot, self.prompt_ids, self.params = slot, prompt_ids, params
        self.block_len, self.stop_ids, self.mask_token_id, self.generator = block_len, stop_ids, mask_token_id, generator
        self.greedy = is_greedy(params.temperature)
        self.max_length = len(prompt_ids) + params.max_new_tokens
        self.start = len(prompt_ids)
        self.anchor = -1
        self.pending: list[Tensor] = []
        self.device = generator.device  # the backend's device: logits, drafts and draws live there
        self._no_drafts = torch.empty(0, dtype=torch.long, device=self.device)
        self.drafts: Tensor = self._no_drafts
        self.draft_ids: list[int] = []  # self.drafts on the host
        self.draft_probs: Tensor | None = None
        self.finished = False

    @property
    def uses_drafter(self) -> bool:
        return self.block_len > 1

    @property
    def pending_context(self) -> int:
        """Committed positions whose taps the draft cache has not taken in yet."""
        return sum(taps.shape[0] for taps in self.pending)

    def stop_drafting(self) -> None:
        """Plain decoding from now on: no draft calls, no context taps to keep (the output is unchanged)."""
        self.block_len, self.pending = 1, []

    def probs(self, logits: Tensor) -> Tensor:
        return sampling_probs(logits, self.params.temperature, self.params.top_p, self.params.top_k)

    def prefill_row(self) -> TargetRow:
        return TargetRow(self.slot, self.prompt_ids, 0, last_only=True)

    def finish_prefill(self, logits: Tensor, taps: Tensor | None) -> Cycle:
        """First token from the last prompt row; the taps of every prompt row are the first draft context."""
        last = logits[-1]
        self.anchor = (int(argmax_rows(last)) if self.greedy
                       else int(draw(self.probs(last.unsqueeze(0)), self.generator)[0]))
        self.pending = [taps] if taps is not None else []
        self.finished = self.anchor in self.stop_ids or self.start + 1 >= self.max_length
        return Cycle([self.anchor], drafted=0, accepted=0, prefill=True, stopped=self.anchor in self.stop_ids,
                     finished=self.finished)

    def draft_row(self, draft_len: int) -> DraftRow | None:
        """The next draft call, or None when this cycle drafts nothing (``draft_len`` 0 or no room left)."""
        block_size = min(draft_len + 1, self.max_length - self.start)  # the block shrinks at the end (parity)
        self.drafts, self.draft_ids, self.draft_probs = self._no_drafts, [], None
        if block_size <= 1:
            return None
        taps = torch.cat(self.pending) if len(self.pending) != 1 else self.pending[0]
        return DraftRow(self.slot, [self.anchor] + [self.mask_token_id] * (block_size - 1), taps, self.start)

    def take_drafts(self, draft_logits: Tensor) -> None:
        """Proposals from draft logits ``[Bc-1, V]``: argmax, or one draw per slot in the sampled mode."""
        self.pending = []  # the draft call injected them
        if self.greedy or self.params.proposal == "greedy":
            self.drafts = argmax_rows(draft_logits)
        else:
            self.draft_probs = self.probs(draft_logits)
            self.drafts = draw(self.draft_probs, self.generator)
        self.draft_ids = self.drafts.tolist()  # host-sync: the verify row needs the ids

    def verify_row(self) -> TargetRow:
        return TargetRow(self.slot, [self.anchor] + self.draft_ids, self.start)

    def finish_verify(self, logits: Tensor, taps: Tensor | None) -> Cycle:
        """Accept, commit the accepted drafts and the bonus, cut at a stop token. Logits ``[K+1, V]``."""
        verdict = self._verify(logits)
        new_tokens = self.draft_ids[:verdict.accepted] + [verdict.bonus]
        new_tokens = new_tokens[:self.max_length - self.start - 1]
        stopped = False
        for index, token in enumerate(new_tokens):
            if token in self.stop_ids:  # cut at the first stop token, which is kept
                new_tokens, stopped = new_tokens[:index + 1], True
                break
        produced = len(new_tokens)
        if taps is not None and self.uses_drafter:
            self.pending.append(taps[:produced])  # the anchor plus the accepted drafts
        self.start += produced
        self.anchor = new_tokens[-1]
        self.finished = stopped or self.start + 1 >= self.max_length
        return Cycle(new_tokens, drafted=len(self.draft_ids), accepted=verdict.accepted, stopped=stopped,
                     finished=self.finished)

    def _verify(self, logits: Tensor) -> Verdict:
        if self.greedy:
            return accept_greedy(self.drafts, logits)
        target_probs = self.probs(logits)
        if self.draft_probs is None:
            return accept_onehot(self.drafts, target_probs, self.generator)
        return accept_rejection(self.drafts, self.draft_probs, target_probs, self.generator)
