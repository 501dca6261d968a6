"""The draft-verify loop for one request (dflash.md §3.2; parity target: ``dflash_generate`` 0.1.0).

``block_len == 1`` runs no drafter: it is plain autoregressive decoding through the same code,
so a speed-up measured against it cannot come from harness differences. The loop yields one
``Cycle`` per target forward; timing and stats belong to the caller (style R11).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.backend import Backend
from dflash_trt.runtime.sampling import draw, sampling_probs
from dflash_trt.runtime.verify import Verdict, accept_greedy, accept_onehot, accept_rejection


@dataclass(frozen=True)
class Cycle:
    """Tokens committed by one target forward. The prefill's single token has ``drafted == 0`` and ``prefill``."""

    tokens: list[int]
    drafted: int
    accepted: int
    prefill: bool = False
    stopped: bool = False


def decode(backend: Backend, prompt_ids: list[int], params: SamplingParams, block_len: int,
           stop_ids: frozenset[int], generator: torch.Generator) -> Iterator[Cycle]:
    """Generate up to ``params.max_new_tokens`` tokens after ``prompt_ids``, yielding each cycle's tokens."""
    greedy = params.temperature <= 0
    drafting = block_len > 1
    mask_token_id = backend.draft_config.mask_token_id if drafting else 0
    max_length = len(prompt_ids) + params.max_new_tokens
    backend.reset()

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, params.temperature, params.top_p, params.top_k)

    # prefill: logits of the last prompt row, taps of every prompt row (the first draft context)
    logits, context = backend.target(torch.tensor([prompt_ids]), 0, drafting, last_only=True)
    anchor = int(logits[-1].argmax()) if greedy else int(draw(probs(logits[-1:]), generator)[0])
    stopped = anchor in stop_ids
    yield Cycle([anchor], drafted=0, accepted=0, prefill=True, stopped=stopped)
    start = len(prompt_ids)
    while not stopped and start + 1 < max_length:
        block_size = min(block_len, max_length - start)  # the block shrinks at the end (parity)
        drafts = torch.empty(0, dtype=torch.long)
        draft_probs = None
        if block_size > 1:
            block = torch.tensor([[anchor] + [mask_token_id] * (block_size - 1)])
            draft_logits = backend.draft(block, context, start)  # [Bc-1, V]
            if greedy or params.proposal == "greedy":
                drafts = draft_logits.argmax(-1)
            else:
                draft_probs = probs(draft_logits)
                drafts = draw(draft_probs, generator)
        block = torch.cat([torch.tensor([anchor]), drafts]).unsqueeze(0)
        target_logits, hidden = backend.target(block, start, drafting)  # row k predicts start+k+1
        verdict = _verify(drafts, target_logits, draft_probs, params, generator)
        new_tokens = drafts[:verdict.accepted].tolist() + [verdict.bonus]  # host-sync: committed ids
        new_tokens = new_tokens[:max_length - start - 1]
        for index, token in enumerate(new_tokens):
            if token in stop_ids:  # cut at the first stop token, which is kept
                new_tokens, stopped = new_tokens[:index + 1], True
                break
        produced = len(new_tokens)
        start += produced
        # crop to start: the bonus is not in the cache; it is verified as slot 0 of the next block
        backend.crop_target(start)
        context = hidden[:produced] if drafting else None
        anchor = new_tokens[-1]
        yield Cycle(new_tokens, drafted=block_size - 1, accepted=verdict.accepted, stopped=stopped)


def _verify(drafts: torch.Tensor, target_logits: torch.Tensor, draft_probs: torch.Tensor | None,
            params: SamplingParams, generator: torch.Generator) -> Verdict:
    if params.temperature <= 0:
        return accept_greedy(drafts, target_logits)
    target_probs = sampling_probs(target_logits, params.temperature, params.top_p, params.top_k)
    if draft_probs is None:
        return accept_onehot(drafts, target_probs, generator)
    return accept_rejection(drafts, draft_probs, target_probs, generator)
