"""Self-distillation data: the target writes its own training text (dflash.md §4 "data", assets.md §7).

The drafter must predict what the *target* will say, so the target generates the training
sequences itself, in its own vocabulary. Prompts of equal length are generated together in one
batch with the target's static KV cache; each sequence ends at the first stop token (kept),
exactly where the serving loop would stop.
"""

from __future__ import annotations

from itertools import groupby

import torch

from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.sampling import draw, sampling_probs

_BATCH_ROWS = 64  # sequences generated together; the target is tiny, the per-step overhead is Python


@torch.no_grad()
def generate_batch(target: TargetModel, prompts: torch.Tensor, max_new_tokens: int, temperature: float,
                   top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Continue equal-length prompts with the target (greedy when ``temperature <= 0``).

    Shapes: prompts ``[R, P]`` -> ``[R, P + max_new_tokens]`` (not cut at stop tokens).
    """
    rows, prompt_len = prompts.shape
    total = prompt_len + max_new_tokens
    cache = target.new_cache(rows, total)
    out = torch.empty(rows, total, dtype=torch.long)
    out[:, :prompt_len] = prompts
    logits, _ = target(prompts, 0, cache, last_only=True)
    for position in range(prompt_len, total):
        last = logits[:, -1].float()  # [R, V]
        if temperature <= 0:
            token = last.argmax(-1)
        else:
            token = draw(sampling_probs(last, temperature, top_p), generator)
        out[:, position] = token
        if position + 1 < total:
            logits, _ = target(token.view(rows, 1), position, cache)
    return out


def cut_at_stop(ids: list[int], start: int, stop_ids: frozenset[int]) -> list[int]:
    """Keep ``ids`` up to and including the first stop token at or after ``start``."""
    for index in range(start, len(ids)):
        if ids[index] in stop_ids:
            return ids[:index + 1]
    return ids


def self_distill_sequences(target: TargetModel, prompts: list[list[int]], *, max_new_tokens: int,
                           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Each prompt followed by the target's own continuation (greedy when ``temperature == 0``, else
    sampled at ``temperature`` with nucleus ``top_p``), cut after the first stop token of the target.

    Deterministic for a given ``seed``; the order of the result follows ``prompts``.
    """
    stop_ids = frozenset(target.config.eos_token_ids)
    generator = torch.Generator().manual_seed(seed)
    results: list[list[int] | None] = [None] * len(prompts)
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for _, group in groupby(by_length, key=lambda i: len(prompts[i])):
        indices = list(group)
        for first in range(0, len(indices), _BATCH_ROWS):
            chunk = indices[first:first + _BATCH_ROWS]
            batch = torch.tensor([prompts[i] for i in chunk], dtype=torch.long)
            generated = generate_batch(target, batch, max_new_tokens, temperature, top_p, generator)
            for row, index in enumerate(chunk):
                results[index] = cut_at_stop(generated[row].tolist(), len(prompts[index]), stop_ids)
    return [ids for ids in results if ids is not None]


def sample_openings(target: TargetModel, count: int, min_tokens: int, max_tokens: int, temperature: float,
                    top_p: float, seed: int) -> list[list[int]]:
    """``count`` story openings: BOS followed by ``k`` tokens sampled from the target, ``k`` cycling through
    ``min_tokens .. max_tokens`` so every length is equally represented. Deterministic for a given seed."""
    bos = target.config.bos_token_id
    assert bos is not None, "caller checks that the target has a BOS token"
    generator = torch.Generator().manual_seed(seed)
    lengths = [min_tokens + i % (max_tokens - min_tokens + 1) for i in range(count)]
    openings: list[list[int]] = []
    for length in sorted(set(lengths)):
        rows = lengths.count(length)
        for first in range(0, rows, _BATCH_ROWS):
            batch = torch.full((min(_BATCH_ROWS, rows - first), 1), bos, dtype=torch.long)
            openings += generate_batch(target, batch, length, temperature, top_p, generator).tolist()
    return openings
