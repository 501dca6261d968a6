"""Interleaved A/B timing of plain decoding vs DFlash in one session (the demo's speed-up).

The baseline is the same session with ``block_len=1`` (no drafter call), as the reference does,
so harness differences cannot inflate the ratio. Runs alternate A B A B after a warm-up so
machine drift cancels; the ratio is of medians of per-request decode speed (1 / TPOT).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import GenerationResult, Session


@dataclass(frozen=True)
class ABResult:
    baseline: list[GenerationResult]
    speculative: list[GenerationResult]

    @staticmethod
    def _median(results: list[GenerationResult], attr: str) -> float:
        return statistics.median(getattr(r.stats, attr) for r in results)

    @property
    def baseline_decode_tps(self) -> float:
        return self._median(self.baseline, "decode_tokens_per_s")

    @property
    def speculative_decode_tps(self) -> float:
        return self._median(self.speculative, "decode_tokens_per_s")

    @property
    def speedup(self) -> float:
        """Median decode tokens/s with DFlash ÷ median without (the z-lab TPOT ratio)."""
        return self.speculative_decode_tps / self.baseline_decode_tps

    @property
    def identical(self) -> bool:
        """Greedy losslessness check: each speculative output equals its baseline run."""
        return all(a.token_ids == b.token_ids for a, b in zip(self.baseline, self.speculative))

    @property
    def mean_acceptance_length(self) -> float:
        lengths = [n for r in self.speculative for n in r.stats.acceptance_lengths]
        return sum(lengths) / len(lengths) if lengths else 0.0


def compare(session: Session, prompts: Sequence[str | Sequence[int]], params: SamplingParams,
            repeats: int = 3, warmup: int = 1) -> ABResult:
    """Run every prompt ``repeats`` times with drafting off (A) and on (B), interleaved; keep the last repeat."""
    plain = params.model_copy(update={"block_len": 1})
    for prompt in list(prompts)[:warmup]:
        session.generate(prompt, plain)
        session.generate(prompt, params)
    baseline: list[GenerationResult] = []
    speculative: list[GenerationResult] = []
    for _ in range(repeats):
        for prompt in prompts:
            baseline.append(session.generate(prompt, plain))
            speculative.append(session.generate(prompt, params))
    return ABResult(baseline, speculative)
