"""Acceptance of a drafter on a prompt set through the real serving path (``Session``; dflash.md §6).

τ is measured the way users will see it: the same draft-verify loop, greedy, at a given block
length and number of new tokens. Counters of all prompts are merged, so τ is the mean of the
per-cycle acceptance lengths over every cycle of every prompt (the bonus token included).
Prompts that leave no room for ``max_new_tokens`` in the target's context are skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dflash_trt.model.pair import ModelPair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.session import Session
from dflash_trt.runtime.stats import SpecStats
from dflash_trt.tokenizer import Tokenizer


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

    @property
    def mean_prompt_tau(self) -> float:
        """Mean over prompts of each prompt's τ (every prompt weighs the same; ``tau`` pools the cycles)."""
        return sum(self.per_prompt_tau) / len(self.per_prompt_tau)

    def to_dict(self) -> dict:
        return {"tau": self.tau, "mean_prompt_tau": self.mean_prompt_tau, "per_position_acceptance": self.per_position,
                "acceptance_histogram": self.histogram,
                "per_prompt_tau": self.per_prompt_tau, "num_prompts": self.num_prompts,
                "num_skipped_too_long": self.num_skipped, "num_output_tokens": self.num_output_tokens,
                "block_len": self.block_len, "max_new_tokens": self.max_new_tokens, "decoding": "greedy"}


def evaluate(target: TargetModel, draft: DraftHead, prompts: Sequence[str | Sequence[int]], *,
             tokenizer: Tokenizer | None = None, block_len: int | None = None,
             max_new_tokens: int = 256) -> EvalReport:
    """Greedy τ, per-position acceptance and the acceptance histogram of ``draft`` on ``prompts``.

    Prompts are text (needs ``tokenizer``) or token ids; ``block_len`` defaults to the drafter's.
    """
    block_len = block_len or draft.config.block_size
    pair = ModelPair(target.eval(), draft.eval(), tokenizer, target_path=None,  # type: ignore[arg-type]
                     draft_path=None)
    session = Session(pair)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, block_len=block_len)
    total = SpecStats()
    per_prompt: list[float] = []
    skipped = 0
    for prompt in prompts:
        ids = session.encode(prompt)
        if len(ids) + max_new_tokens > session.max_seq_len:
            skipped += 1
            continue
        result = session.generate(ids, params)
        per_prompt.append(result.stats.mean_acceptance_length)
        total = total.merge(result.stats)
    if not per_prompt:
        raise TrainingError(f"eval: all {skipped} prompts are longer than the context ({session.max_seq_len}) minus "
                            f"max_new_tokens ({max_new_tokens}); expected at least one that fits. Fix: pass a "
                            "smaller --max-new-tokens or shorter prompts.")
    return EvalReport(tau=total.mean_acceptance_length, per_position=total.per_position_acceptance,
                      histogram=total.acceptance_histogram, per_prompt_tau=per_prompt, num_prompts=len(per_prompt),
                      num_skipped=skipped, num_output_tokens=total.num_output_tokens, block_len=block_len,
                      max_new_tokens=max_new_tokens)
