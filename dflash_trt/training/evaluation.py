"""Acceptance of a drafter on a prompt set through the real serving path (``Session``; docs/algorithm.md §6).

τ is measured the way users will see it: the same draft-verify loop, at a given block length and
number of new tokens; greedy by default, or sampled at a temperature with either proposal mode
(docs/algorithm.md §3.4; each prompt then runs ``seeds`` times, with request seed
``1000 * repeat + prompt index``). Counters of all prompts are merged, so τ is the mean of the
per-cycle acceptance lengths over every cycle of every prompt (the bonus token included).
Prompts that leave no room for ``max_new_tokens`` in the target's context are skipped and counted.
A DFlash2 drafter is measured with ``walk_eval.py``'s loop, which proposes with its candidate selector
(docs/algorithm.md §2.11) and follows the runtime's cycle rules; the serving runtime here proposes each slot's
argmax, which is lossless but not the drafter's proposal.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import Literal, Sequence

from dflash_trt.model.pair import ModelPair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.session import Session
from dflash_trt.runtime.stats import SpecStats
from dflash_trt.tokenizer import Tokenizer

REPEAT_SEED_STRIDE = 1000  # request seed = 1000 * repeat + prompt index (as in tools/proposal_modes.py)


@dataclass(frozen=True)
class EvalReport:
    """Acceptance over a prompt set. ``tau`` pools every cycle of every prompt; ``per_position[i]``: cycles
    accepting >= i+1 drafts / cycles drafting i; ``histogram[j]``: cycles accepting exactly j drafts;
    ``per_prompt_tau``: τ of each evaluated prompt."""

    tau: float
    per_position: list[float]
    histogram: list[int]
    per_prompt_tau: list[float]
    num_prompts: int
    num_skipped: int
    num_output_tokens: int
    block_len: int
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    proposal: str = "greedy"
    seeds: int = 1

    @property
    def mean_prompt_tau(self) -> float:
        """Mean over prompts of each prompt's τ (every prompt weighs the same; ``tau`` pools the cycles)."""
        return sum(self.per_prompt_tau) / len(self.per_prompt_tau)

    def to_dict(self) -> dict:
        return {"tau": self.tau, "mean_prompt_tau": self.mean_prompt_tau, "per_position_acceptance": self.per_position,
                "acceptance_histogram": self.histogram,
                "per_prompt_tau": self.per_prompt_tau, "num_prompts": self.num_prompts,
                "num_skipped_too_long": self.num_skipped, "num_output_tokens": self.num_output_tokens,
                "block_len": self.block_len, "max_new_tokens": self.max_new_tokens,
                "decoding": self.decoding}

    @property
    def decoding(self) -> str:
        """``greedy``, or e.g. ``T=0.7 top-p=1 sampled proposals x 3 seeds``."""
        if self.temperature == 0:
            return "greedy"
        return f"T={self.temperature:g} top-p={self.top_p:g} {self.proposal} proposals x {self.seeds} seeds"


def evaluate(target: TargetModel, draft: DraftHead, prompts: Sequence[str | Sequence[int]], *,
             tokenizer: Tokenizer | None = None, block_len: int | None = None, max_new_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, proposal: Literal["greedy", "sampled"] = "greedy",
             seeds: int = 1) -> EvalReport:
    """τ, per-position acceptance and the acceptance histogram of ``draft`` on ``prompts``.

    Prompts are text (needs ``tokenizer``) or token ids; ``block_len`` defaults to the drafter's.
    ``temperature`` 0 is greedy (one run per prompt); above 0 every prompt runs ``seeds`` times.
    """
    block_len = block_len or draft.config.block_size
    dtype = target.embed_tokens.weight.dtype
    if draft.fc.weight.dtype != dtype:  # a drafter trained in float32 beside a half-precision target: served in
        draft = copy.deepcopy(draft).to(dtype)  # the target's dtype, as `run` would (the caller's copy is left)
    pair = ModelPair(target.eval(), draft.eval(), tokenizer, target_path=None,  # type: ignore[arg-type]
                     draft_path=None)
    limit = min(target.config.max_position_embeddings, draft.config.max_position_embeddings)
    if tokenizer is not None or all(not isinstance(prompt, str) for prompt in prompts):
        # the context the prompts need: the KV cache holds no position no request reaches
        lengths = [len(tokenizer.encode(p) if isinstance(p, str) else p) for p in prompts]
        limit = min(limit, max(lengths, default=0) + max_new_tokens) if lengths else limit
    session = Session(pair, max_seq_len=max(limit, 1))
    repeats = seeds if temperature > 0 else 1
    if draft.candidate_selector is not None:
        return _evaluate_dflash2(session, target, draft, prompts, block_len, max_new_tokens, temperature, top_p,
                                 proposal, repeats)
    total = SpecStats()
    per_prompt: list[float] = []
    skipped = 0
    for index, prompt in enumerate(prompts):
        ids = session.encode(prompt)
        if len(ids) + max_new_tokens > session.max_seq_len:
            skipped += 1
            continue
        prompt_stats = SpecStats()
        for repeat in range(repeats):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    block_len=block_len, proposal=proposal,
                                    seed=REPEAT_SEED_STRIDE * repeat + index if temperature > 0 else None)
            prompt_stats = prompt_stats.merge(session.generate(ids, params).stats)
        per_prompt.append(prompt_stats.mean_acceptance_length)
        total = total.merge(prompt_stats)
    if not per_prompt:
        raise TrainingError(f"eval: all {skipped} prompts are longer than the context ({session.max_seq_len}) minus "
                            f"max_new_tokens ({max_new_tokens}); expected at least one that fits. Fix: pass a "
                            "smaller --max-new-tokens or shorter prompts.")
    return EvalReport(tau=total.mean_acceptance_length, per_position=total.per_position_acceptance,
                      histogram=total.acceptance_histogram, per_prompt_tau=per_prompt, num_prompts=len(per_prompt),
                      num_skipped=skipped, num_output_tokens=total.num_output_tokens, block_len=block_len,
                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, proposal=proposal,
                      seeds=repeats)


def _evaluate_dflash2(session: Session, target: TargetModel, draft: DraftHead, prompts: Sequence[str | Sequence[int]],
                      block_len: int, max_new_tokens: int, temperature: float, top_p: float,
                      proposal: Literal["greedy", "sampled"], repeats: int) -> EvalReport:
    """:func:`evaluate` for a DFlash2 drafter, through ``walk_eval.speculative_decode`` (module docstring)."""
    from dflash_trt.training.walk_eval import WalkStats, speculative_decode

    if top_p != 1.0:
        raise TrainingError(f"eval: --top-p is {top_p} with a DFlash2 drafter; expected 1 (this evaluation of the "
                            "selector's sparse proposals samples from the full target distribution). Fix: drop --top-p.")
    stop_ids = frozenset(target.config.eos_token_ids)
    total, per_prompt, skipped = WalkStats(), [], 0
    for index, prompt in enumerate(prompts):
        ids = session.encode(prompt)
        if len(ids) + max_new_tokens > session.max_seq_len:
            skipped += 1
            continue
        prompt_stats = WalkStats()
        for repeat in range(repeats):
            _, stats = speculative_decode(target, draft, ids, max_new_tokens, stop_ids=stop_ids, temperature=temperature,
                                          proposal=proposal, seed=REPEAT_SEED_STRIDE * repeat + index,
                                          block_len=block_len)
            prompt_stats = prompt_stats.merge(stats)
        per_prompt.append(prompt_stats.tau)
        total = total.merge(prompt_stats)
    if not per_prompt:
        raise TrainingError(f"eval: all {skipped} prompts are longer than the context ({session.max_seq_len}) minus "
                            f"max_new_tokens ({max_new_tokens}); expected at least one that fits. Fix: pass a "
                            "smaller --max-new-tokens or shorter prompts.")
    return EvalReport(tau=total.tau, per_position=total.per_position, histogram=total.histogram,
                      per_prompt_tau=per_prompt, num_prompts=len(per_prompt), num_skipped=skipped,
                      num_output_tokens=total.output_tokens, block_len=block_len, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_p=top_p, proposal=proposal, seeds=repeats)
