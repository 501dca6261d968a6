"""Acceptance of a drafter on a prompt set through the real serving path (``Session``; docs/algorithm.md §6).

τ is measured the way users will see it: the same draft-verify loop, at a given block length and
number of new tokens; greedy by default, or sampled at a temperature with either proposal mode
(docs/algorithm.md §3.4; each prompt then runs ``seeds`` times, with request seed
``1000 * repeat + prompt index``). Counters of all prompts are merged, so τ is the mean of the
per-cycle acceptance lengths over every cycle of every prompt (the bonus token included).
Prompts that leave no room for ``max_new_tokens`` in the target's context are skipped and counted.
DFlash and DFlash2 drafters are measured alike: a DFlash2 drafter proposes in the runtime with its candidate
selector (docs/algorithm.md §2.11; ``Backend.propose_batch``).
:class:`Evaluation` runs one prompt at a time, so :func:`compare_drafters` can interleave several drafters and
plain decoding prompt by prompt (``tools/compare_drafters.py``, docs/drafters.md).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Literal, Sequence

from dflash_trt.model.pair import ModelPair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.session import GenerationResult, Session
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
    evaluation = Evaluation(target, draft, prompts, tokenizer=tokenizer, block_len=block_len,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, proposal=proposal,
                            seeds=seeds)
    for index, prompt in enumerate(prompts):
        evaluation.run_prompt(index, prompt)
    return evaluation.report()


class Evaluation:
    """:func:`evaluate` one prompt at a time, so a caller can interleave several drafters prompt by prompt
    (``tools/compare_drafters.py``). ``draft`` None measures plain decoding (its τ is 1)."""

    def __init__(self, target: TargetModel, draft: DraftHead | None, prompts: Sequence[str | Sequence[int]], *,
                 tokenizer: Tokenizer | None = None, block_len: int | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, proposal: Literal["greedy", "sampled"] = "greedy",
                 seeds: int = 1) -> None:
        dtype = target.embed_tokens.weight.dtype
        if draft is not None and draft.fc.weight.dtype != dtype:  # a drafter trained in float32 beside a
            draft = copy.deepcopy(draft).to(dtype)  # half-precision target: served in the target's dtype, as `run`
        pair = ModelPair(target.eval(), draft.eval() if draft is not None else None, tokenizer,  # would
                         target_path=None, draft_path=None)  # type: ignore[arg-type]
        limit = target.config.max_position_embeddings
        if draft is not None:
            limit = min(limit, draft.config.max_position_embeddings)
        if tokenizer is not None or all(not isinstance(prompt, str) for prompt in prompts):
            # the context the prompts need: the KV cache holds no position no request reaches
            lengths = [len(tokenizer.encode(p) if isinstance(p, str) else p) for p in prompts]
            limit = min(limit, max(lengths, default=0) + max_new_tokens) if lengths else limit
        self.session = Session(pair, max_seq_len=max(limit, 1))
        self.block_len = block_len or (draft.config.block_size if draft is not None else 1)
        self.max_new_tokens, self.temperature, self.top_p, self.proposal = max_new_tokens, temperature, top_p, proposal
        self.repeats = seeds if temperature > 0 else 1
        self.total = SpecStats()
        self.per_prompt: list[float] = []
        self.skipped = 0

    def run_prompt(self, index: int, prompt: str | Sequence[int]) -> list[GenerationResult]:
        """Generate ``prompt`` (the ``index``-th: request seed ``1000 * repeat + index`` when sampling) every
        repeat and count it; returns the generations, none for a prompt too long for the context (skipped)."""
        ids = self.session.encode(prompt)
        if len(ids) + self.max_new_tokens > self.session.max_seq_len:
            self.skipped += 1
            return []
        results = []
        prompt_stats = SpecStats()
        for repeat in range(self.repeats):
            params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                    block_len=self.block_len, proposal=self.proposal,
                                    seed=REPEAT_SEED_STRIDE * repeat + index if self.temperature > 0 else None)
            results.append(self.session.generate(ids, params))
            prompt_stats = prompt_stats.merge(results[-1].stats)
        self.per_prompt.append(prompt_stats.mean_acceptance_length)
        self.total = self.total.merge(prompt_stats)
        return results

    def report(self) -> EvalReport:
        """The counters of every prompt run so far."""
        if not self.per_prompt:
            raise TrainingError(f"eval: all {self.skipped} prompts are longer than the context "
                                f"({self.session.max_seq_len}) minus max_new_tokens ({self.max_new_tokens}); expected "
                                "at least one that fits. Fix: pass a smaller --max-new-tokens or shorter prompts.")
        total = self.total
        return EvalReport(tau=total.mean_acceptance_length, per_position=total.per_position_acceptance,
                          histogram=total.acceptance_histogram, per_prompt_tau=self.per_prompt,
                          num_prompts=len(self.per_prompt), num_skipped=self.skipped,
                          num_output_tokens=total.num_output_tokens, block_len=self.block_len,
                          max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                          proposal=self.proposal, seeds=self.repeats)


@dataclass(frozen=True)
class DrafterRow:
    """One drafter's line of :func:`compare_drafters`: τ per cycle and per prompt, per-position acceptance, the
    mean draft and verify forward at the full block (milliseconds; None when the run had no full block), the wall
    seconds of its generations, and (T = 0) its speed-up over plain decoding of the same prompts."""

    name: str
    tau: float
    mean_prompt_tau: float
    per_position: list[float]
    cycles: int
    draft_ms_per_call: float | None
    verify_ms_per_call: float | None
    seconds: float
    speedup: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def compare_drafters(target: TargetModel, drafters: dict[str, DraftHead], prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int = 256, temperature: float = 0.0,
                     proposal: Literal["greedy", "sampled"] = "sampled", seeds: int = 1) -> list[DrafterRow]:
    """:class:`Evaluation` of every drafter (and, at T = 0, of plain decoding) interleaved prompt by prompt, so a
    busy machine slows all of them alike; seeds as :func:`evaluate`'s.

    The speed-up is plain decoding's wall seconds over the drafter's, summed over the prompts (T = 0 only: both
    then produce the same tokens, which is checked: a difference raises ``AssertionError``)."""
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, proposal=proposal, seeds=seeds)
    evaluations = {name: Evaluation(target, draft, prompts, **settings) for name, draft in drafters.items()}
    plain = Evaluation(target, None, prompts, max_new_tokens=max_new_tokens) if temperature <= 0 else None
    marks = {name: (ev.session.measure_costs(), ev.session.costs.mark()) for name, ev in evaluations.items()}
    seconds = {name: 0.0 for name in drafters}
    plain_seconds = 0.0
    for index, prompt in enumerate(prompts):
        reference = None
        if plain is not None:
            began = time.perf_counter()
            reference = [result.token_ids for result in plain.run_prompt(index, prompt)]
            plain_seconds += time.perf_counter() - began
        for name, evaluation in evaluations.items():
            began = time.perf_counter()
            outputs = [result.token_ids for result in evaluation.run_prompt(index, prompt)]
            seconds[name] += time.perf_counter() - began
            if reference is not None and outputs != reference:
                raise AssertionError(f"{name}: greedy speculative output differs from plain decoding on prompt {index}")
    rows = []
    for name, evaluation in evaluations.items():
        report = evaluation.report()
        costs, mark = marks[name]
        width = report.block_len
        draft_ms, verify_ms = (_mean_ms(costs, mark, kind, width) for kind in ("draft", "verify"))
        rows.append(DrafterRow(name, report.tau, report.mean_prompt_tau, report.per_position[:8],
                               sum(report.histogram), draft_ms, verify_ms, seconds[name],
                               plain_seconds / seconds[name] if plain is not None else None))
    return rows


def _mean_ms(costs: CostModel, mark: dict[tuple, int], kind: str, width: int) -> float | None:
    """Mean milliseconds of the ``kind`` forwards of one row at ``width`` measured since ``mark``."""
    try:
        return 1e3 * costs.breakdown(1, width - 1, since=mark).to_dict()[f"{kind}_s"]
    except LookupError:
        return None
