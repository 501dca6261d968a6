"""Acceptance and cost of a DFlash or DFlash2 drafter measured by one plain speculative loop (docs/drafters.md).

``evaluation.py`` measures τ through the serving runtime (``Session``). This module holds a second,
deliberately simple loop of one request at a time, which proposes with a DFlash2 drafter's candidate
selector (docs/algorithm.md §2.11) as well as with a DFlash drafter's argmax, so the two can be compared
on the same code when the runtime does not run the selector; on DFlash drafters at T = 0 it gives the
runtime's acceptance lengths exactly (``tests/training/test_walk_eval.py``). Each cycle follows the
runtime's rules (docs/algorithm.md §3.2): the block shrinks at the end (``min(B, room left)``), the output
is cut at the first stop token, the bonus is verified as the next anchor, and τ counts the committed tokens
of each cycle (the bonus included).

Proposals and verification:

* T = 0: DFlash proposes each slot's argmax, DFlash2 the selector's greedy walk from the anchor; a draft
  is accepted while it equals the target's argmax (§3.3).
* T > 0, ``sampled`` proposals: DFlash draws each slot from ``softmax(logits / T)``, DFlash2 walks the
  selector drawing each slot from ``softmax(score / T)`` over its candidates (a sparse ``q``); standard
  rejection accepts ``x`` with probability ``min(1, p(x) / q(x))`` and on a rejection draws from
  ``norm(max(p - q, 0))`` (§3.4). ``greedy`` proposals (the argmax or the greedy walk) use the one-hot
  ``q`` of the proposal.

Timing: the seconds spent in draft calls (the drafter's forward plus its proposals, read back to the host)
and in target forwards are summed per loop; ``plain_decode`` runs the same target forwards one token at a
time, so a speed-up measured against it comes from the drafter alone.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.model.candidate_selector import greedy_choice, sampled_choice
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel


@dataclass
class WalkStats:
    """Counters of one or more generations: per-cycle committed tokens, per-position acceptance, seconds."""

    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # [j]: cycles that accepted exactly j drafts
    draft_times: list[float] = field(default_factory=list)  # seconds of each draft call
    target_seconds: float = 0.0
    output_tokens: int = 0

    @property
    def tau(self) -> float:
        """Mean committed tokens per cycle (accepted drafts + the bonus; docs/algorithm.md §6)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def draft_calls(self) -> int:
        return len(self.draft_times)

    @property
    def draft_ms_per_call(self) -> float:
        """Median milliseconds of one draft call (forward + proposals; robust to a busy machine)."""
        return 1e3 * statistics.median(self.draft_times) if self.draft_times else 0.0

    def observe(self, drafted: int, accepted: int, produced: int) -> None:
        self.acceptance_lengths.append(produced)
        for counts in (self.accepted_per_position, self.drafted_per_position):
            counts.extend([0] * (drafted - len(counts)))
        self.histogram.extend([0] * (drafted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1
        for position in range(drafted):
            self.drafted_per_position[position] += 1
            self.accepted_per_position[position] += position < accepted

    def merge(self, other: WalkStats) -> WalkStats:
        def added(mine: list[int], theirs: list[int]) -> list[int]:
            width = max(len(mine), len(theirs))
            return [a + b for a, b in zip(mine + [0] * (width - len(mine)), theirs + [0] * (width - len(theirs)))]

        return WalkStats(self.acceptance_lengths + other.acceptance_lengths,
                         added(self.accepted_per_position, other.accepted_per_position),
                         added(self.drafted_per_position, other.drafted_per_position),
                         added(self.histogram, other.histogram),
                         self.draft_times + other.draft_times, self.target_seconds + other.target_seconds, self.output_tokens + other.output_tokens)


@dataclass(frozen=True)
class Proposal:
    """One block's drafts and, when sampling, each slot's proposal distribution as (ids, probabilities).

    Shapes: tokens ``[K]``; support and probs ``[K, n]`` (n = V for DFlash, top_k for DFlash2) or None (T = 0)."""

    tokens: Tensor
    support: Tensor | None = None
    probs: Tensor | None = None


def propose(draft: DraftHead, hidden: Tensor, lm_head_weight: Tensor, anchor: int, temperature: float,
            mode: Literal["greedy", "sampled"], generator: torch.Generator) -> Proposal:
    """The drafts of one block (module docstring). Shapes: hidden ``[1, K, H]`` -> :class:`Proposal`."""
    sample = temperature > 0 and mode == "sampled"
    if draft.candidate_selector is None:
        logits = draft.logits(hidden, lm_head_weight)[0].float()  # [K, V]
        if not sample:
            return Proposal(logits.argmax(-1))
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return Proposal(tokens, torch.arange(probs.shape[-1]).expand_as(probs), probs)
    anchors = torch.tensor([anchor], device=hidden.device)
    if not sample:
        return Proposal(draft.propose(hidden, lm_head_weight, anchors, greedy_choice).tokens[0])
    uniforms = torch.rand(1, hidden.shape[1], generator=generator)
    walk = draft.propose(hidden, lm_head_weight, anchors, sampled_choice(temperature, uniforms))
    return Proposal(walk.tokens[0], walk.candidates[0], walk.probabilities(temperature)[0])


def verify(proposal: Proposal, target_logits: Tensor, temperature: float, generator: torch.Generator
           ) -> tuple[int, int]:
    """(accepted drafts, the token after them) for target logits ``[K+1, V]`` (module docstring)."""
    drafts = proposal.tokens.tolist()
    if temperature <= 0:
        predicted = target_logits.argmax(-1).tolist()
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, predicted)) if d != t), len(drafts))
        return accepted, predicted[accepted]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [K+1, V]
    for slot, token in enumerate(drafts):
        q = torch.zeros_like(p[slot])
        if proposal.probs is None:  # greedy proposals: q is one-hot on the draft
            q[token] = 1.0
        else:
            q.index_put_((proposal.support[slot],), proposal.probs[slot].float(), accumulate=True)
        ratio = float(p[slot, token] / q[token])
        if float(torch.rand((), generator=generator)) >= ratio:
            residual = (p[slot] - q).clamp_min(0.0)
            residual = residual if float(residual.sum()) > 0 else p[slot]
            return slot, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


@torch.no_grad()
def speculative_decode(target: TargetModel, draft: DraftHead, prompt: Sequence[int], max_new_tokens: int, *,
                       stop_ids: frozenset[int] = frozenset(), temperature: float = 0.0,
                       proposal: Literal["greedy", "sampled"] = "greedy", seed: int = 0,
                       block_len: int | None = None) -> tuple[list[int], WalkStats]:
    """Generate with ``draft`` proposing and ``target`` verifying; returns (new tokens, stats)."""
    cfg = draft.config
    block_len = block_len or cfg.block_size
    generator = torch.Generator().manual_seed(seed)
    max_length = len(prompt) + max_new_tokens
    target_cache, draft_cache = target.new_cache(1, max_length + block_len), draft.new_cache(1, max_length + block_len)
    embed, lm_head = target.embed_tokens.weight, target.lm_head.weight
    stats = WalkStats()
    began = time.perf_counter()
    logits, taps = target(torch.tensor([list(prompt)]), 0, target_cache, cfg.target_layer_ids, last_only=True)
    last = logits[0, -1].float()
    anchor = int(last.argmax()) if temperature <= 0 else int(
        torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator))
    stats.target_seconds += time.perf_counter() - began
    out, start, pending = [anchor], len(prompt), taps[0]
    while anchor not in stop_ids and start + 1 < max_length:
        size = min(block_len, max_length - start)
        began = time.perf_counter()
        block = torch.tensor([[anchor] + [cfg.mask_token_id] * (size - 1)])
        hidden = draft(F.embedding(block, embed) * cfg.input_embedding_scale, pending.unsqueeze(0), start,
                       draft_cache)
        draft_cache.crop(start)  # block K/V never survive a cycle (docs/algorithm.md §3.5)
        drafts = propose(draft, hidden, lm_head, anchor, temperature, proposal, generator)
        ids = drafts.tokens.tolist()  # host-sync: the verify forward needs the ids
        stats.draft_times.append(time.perf_counter() - began)
        began = time.perf_counter()
        logits, taps = target(torch.tensor([[anchor] + ids]), start, target_cache, cfg.target_layer_ids)
        accepted, bonus = verify(drafts, logits[0], temperature, generator)
        stats.target_seconds += time.perf_counter() - began
        new = (ids[:accepted] + [bonus])[:max_length - start - 1]
        cut = next((i for i, token in enumerate(new) if token in stop_ids), None)
        new = new if cut is None else new[:cut + 1]
        stats.observe(len(ids), accepted, len(new))
        pending = taps[0, :len(new)]  # the anchor and the accepted drafts
        start += len(new)
        target_cache.crop(start)  # the bonus is verified as the next anchor
        anchor = new[-1]
        out += new
    stats.output_tokens = len(out)
    return out, stats


@torch.no_grad()
def plain_decode(target: TargetModel, prompt: Sequence[int], max_new_tokens: int, *,
                 stop_ids: frozenset[int] = frozenset()) -> tuple[list[int], float]:
    """Greedy decoding one target forward per token (the baseline of a speed-up); returns (new tokens, seconds)."""
    cache = target.new_cache(1, len(prompt) + max_new_tokens)
    began = time.perf_counter()
    logits, _ = target(torch.tensor([list(prompt)]), 0, cache, last_only=True)
    out = [int(logits[0, -1].argmax())]
    while out[-1] not in stop_ids and len(out) < max_new_tokens:
        logits, _ = target(torch.tensor([[out[-1]]]), len(prompt) + len(out) - 1, cache)
        out.append(int(logits[0, -1].argmax()))
    return out, time.perf_counter() - began


@dataclass(frozen=True)
class DrafterRow:
    """One drafter's line of a comparison: τ per cycle and per prompt, per-position acceptance, the median draft
    call, the mean target forward per cycle, and (T = 0) its speed-up over plain decoding of the same prompts."""

    name: str
    tau: float
    mean_prompt_tau: float
    per_position: list[float]
    cycles: int
    draft_ms_per_call: float
    target_ms_per_cycle: float
    seconds: float
    speedup: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def compare_drafters(target: TargetModel, drafters: dict[str, DraftHead], prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int = 256, temperature: float = 0.0,
                     proposal: Literal["greedy", "sampled"] = "sampled", seeds: int = 1) -> list[DrafterRow]:
    """Run every drafter (and, at T = 0, plain decoding) on every prompt, interleaved prompt by prompt so a busy
    machine slows all of them alike. At T > 0 each prompt runs ``seeds`` times with seed ``1000·run + index``.

    The speed-up is plain decoding's seconds over the drafter's, summed over the prompts (T = 0 only: both then
    produce the same tokens, which is checked)."""
    stop_ids = frozenset(target.config.eos_token_ids)
    runs = seeds if temperature > 0 else 1
    totals = {name: WalkStats() for name in drafters}
    per_prompt: dict[str, list[float]] = {name: [] for name in drafters}
    seconds = {name: 0.0 for name in drafters}
    plain_seconds = 0.0
    for index, prompt in enumerate(prompts):
        reference = None
        if temperature <= 0:
            reference, spent = plain_decode(target, prompt, max_new_tokens, stop_ids=stop_ids)
            plain_seconds += spent
        for name, draft in drafters.items():
            prompt_stats = WalkStats()
            for run in range(runs):
                began = time.perf_counter()
                out, stats = speculative_decode(target, draft, prompt, max_new_tokens, stop_ids=stop_ids,
                                                temperature=temperature, proposal=proposal, seed=1000 * run + index)
                seconds[name] += time.perf_counter() - began
                if reference is not None and out != reference:
                    raise AssertionError(f"{name}: greedy speculative output differs from plain decoding on "
                                         f"prompt {index}")
                prompt_stats = prompt_stats.merge(stats)
            per_prompt[name].append(prompt_stats.tau)
            totals[name] = totals[name].merge(prompt_stats)
    rows = []
    for name in drafters:
        stats = totals[name]
        rows.append(DrafterRow(name, stats.tau, sum(per_prompt[name]) / len(per_prompt[name]), stats.per_position[:8],
                               len(stats.acceptance_lengths), stats.draft_ms_per_call,
                               1e3 * stats.target_seconds / max(stats.draft_calls, 1), seconds[name],
                               plain_seconds / seconds[name] if temperature <= 0 else None))
    return rows
