"""Self-distillation data: the target writes its own training text (docs/algorithm.md §4 "data", docs/assets.md §7).

The drafter must predict what the *target* will say, so the target generates the training
sequences itself, in its own vocabulary. Prompts of equal length are generated together in one
batch with the target's static KV cache; each sequence ends at the first stop token (kept),
exactly where the serving loop would stop. Continuations are generated in chunks of rows, each chunk
with its own seeded generator (greedy chunks draw nothing), so ranks can share the work and still
produce the single-process corpus.
"""

from __future__ import annotations

import hashlib
from itertools import groupby

import torch

from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.sampling import sampling_probs

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
            # torch.multinomial with the chunk's generator: the draws every cached corpus (and the shipped
            # drafters' data) were made with, whatever the serving loop's own sampler does
            token = torch.multinomial(sampling_probs(last, temperature, top_p), 1, generator=generator).squeeze(-1)
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


def chunk_seed(seed: int, chunk: int) -> int:
    """Seed of chunk ``chunk``'s generator: ``seed`` for chunk 0, a sha256-derived 63-bit value otherwise.

    Each chunk of rows draws from its own generator, so any process can generate any chunk and the
    corpus is the same whichever rank made which chunk (rank-sharded generation)."""
    if chunk == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{chunk}".encode()).digest()[:8], "little") >> 1


def continuation_chunks(prompts: list[list[int]]) -> list[list[int]]:
    """Prompt indices grouped into generation chunks: equal lengths, at most ``_BATCH_ROWS`` rows, shortest first."""
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks: list[list[int]] = []
    for _, group in groupby(by_length, key=lambda i: len(prompts[i])):
        indices = list(group)
        chunks += [indices[first:first + _BATCH_ROWS] for first in range(0, len(indices), _BATCH_ROWS)]
    return chunks


def continue_prompts(target: TargetModel, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, rank: int = 0, world_size: int = 1) -> dict[int, list[int]]:
    """The continuations of this rank's chunks (chunk ``c`` belongs to rank ``c % world_size``), by prompt index.

    See :func:`self_distill_sequences`; the union over all ranks is the single-process result.
    """
    stop_ids = frozenset(target.config.eos_token_ids)
    results: dict[int, list[int]] = {}
    for number, chunk in enumerate(continuation_chunks(prompts)):
        if number % world_size != rank:
            continue
        generator = torch.Generator().manual_seed(chunk_seed(seed, number))
        batch = torch.tensor([prompts[i] for i in chunk], dtype=torch.long)
        generated = generate_batch(target, batch, max_new_tokens, temperature, top_p, generator)
        for row, index in enumerate(chunk):
            results[index] = cut_at_stop(generated[row].tolist(), len(prompts[index]), stop_ids)
    return results


def self_distill_sequences(target: TargetModel, prompts: list[list[int]], *, max_new_tokens: int,
                           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Each prompt followed by the target's own continuation (greedy when ``temperature == 0``, else
    sampled at ``temperature`` with nucleus ``top_p``), cut after the first stop token of the target.

    Deterministic for a given ``seed``; the order of the result follows ``prompts``.
    """
    found = continue_prompts(target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             seed=seed)
    return [found[i] for i in range(len(prompts))]


def sample_openings(target: TargetModel, count: int, min_tokens: int, max_tokens: int, temperature: float,
                    top_p: float, seed: int) -> list[list[int]]:
    """``count`` story openings: BOS followed by ``k`` tokens sampled from the target, ``k`` cycling through
    ``min_tokens .. max_tokens`` so every length is equally represented. Deterministic for a given seed.

    One generator runs through all of them, so every rank of a sharded run makes them all (they are short:
    a few percent of the corpus's generation time) and the openings stay those of earlier versions."""
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
