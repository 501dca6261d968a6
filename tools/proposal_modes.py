"""Measure the two lossless sampling proposal modes (docs/algorithm.md §3.4) on the embedded pair.

    .venv/bin/python tools/proposal_modes.py            # prints a markdown table (docs/decoding.md)

Variant A (`greedy`): argmax drafts, one-hot rejection. Variant B (`sampled`): drafts sampled from q,
standard rejection (the dflash 0.1.0 rule). Both emit target-distributed tokens (tests/runtime/
test_sampling_exactness.py); they differ only in how many drafts survive, i.e. τ and speed.
"""

from __future__ import annotations

import statistics
import time

import torch

from dflash_trt.bench.datasets import load_dataset
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session

SEEDS = 3
MAX_NEW_TOKENS = 128


def main() -> None:
    torch.set_num_threads(1)
    session = Session.from_checkpoints()
    prompts = [p.text for p in load_dataset("tinystories").prompts]
    print("| T | top-p | proposal | τ (mean acceptance length) | draft acceptance | decode tok/s (median) |")
    print("|---|---|---|---|---|---|")
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        rows = {}
        for proposal in ("greedy", "sampled"):
            lengths, drafted, accepted, speeds = [], 0, 0, []
            for seed in range(SEEDS):
                for index, prompt in enumerate(prompts):
                    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, top_p=top_p,
                                            seed=seed * 1000 + index, proposal=proposal)
                    result = session.generate(prompt, params)
                    lengths += result.stats.acceptance_lengths
                    drafted += result.stats.num_draft_tokens
                    accepted += result.stats.num_accepted_tokens
                    speeds.append(result.stats.decode_tokens_per_s)
            rows[proposal] = (sum(lengths) / len(lengths), accepted / max(drafted, 1), statistics.median(speeds))
        for proposal, (tau, rate, speed) in rows.items():
            print(f"| {temperature:g} | {top_p:g} | {proposal} | {tau:.2f} | {rate:.1%} | {speed:,.0f} |")


if __name__ == "__main__":
    began = time.perf_counter()
    main()
    print(f"\n({len(load_dataset('tinystories').prompts)} held-out TinyStories prompts × {SEEDS} seeds, "
          f"{MAX_NEW_TOKENS} new tokens, block_len = the drafter's, torch float32, 1 thread; "
          f"{time.perf_counter() - began:.0f} s)")
