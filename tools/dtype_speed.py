"""Plain decoding speed of one target checkpoint in several dtypes on the torch backend, interleaved A/B.

Run from the repository root (a 0.6B-shaped target holds ~3.6 GB in float32 + bfloat16 at once)::

    .venv/bin/python tools/dtype_speed.py /tmp/ckpt/qwen3-0.6b --dtypes float32,bfloat16 --rounds 5

Each dtype gets its own session over the same checkpoint (loaded straight into that dtype). Every round runs
one greedy request of ``--max-new-tokens`` plain-decoding tokens (``block_len`` 1) per dtype, in alternating
order, so drift of the machine's speed lands on both; it prints each dtype's decode tok/s per round (1/TPOT,
prompt excluded), their medians, and the median of the per-round ratios to the first dtype. Whether the dtypes'
greedy outputs agree is printed too (they need not: rounding differs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_trt.formats.load import DTYPES, load_pair  # noqa: E402
from dflash_trt.config import SamplingParams  # noqa: E402
from dflash_trt.runtime.session import Session  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    args = parser.parse_args()
    names = args.dtypes.split(",")
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        parser.error(f"--dtypes has {unknown}; expected names from {sorted(DTYPES)}")
    sessions = {}
    for name in names:
        began = time.perf_counter()
        pair = load_pair(args.target, None, dtype=name, use_draft=False)
        sessions[name] = Session(pair, max_seq_len=args.prompt_len + args.max_new_tokens + 1)
        print(f"{name}: loaded in {time.perf_counter() - began:.1f} s", flush=True)
    vocab = pair.target.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, block_len=1)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list[int]] = {}
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            result = sessions[name].generate(prompt, params)
            speeds[name].append(result.stats.decode_tokens_per_s)
            outputs[name] = result.token_ids
        print(f"round {round_index}: " + ", ".join(f"{n} {speeds[n][-1]:.2f} tok/s" for n in names), flush=True)
    base = names[0]
    print(f"threads {torch.get_num_threads()}, {args.max_new_tokens} new tokens after {args.prompt_len}, "
          f"{args.rounds} rounds, medians:")
    for name in names:
        ratios = [s / b for s, b in zip(speeds[name], speeds[base])]
        print(f"  {name}: {statistics.median(speeds[name]):.2f} tok/s  (x{statistics.median(ratios):.2f} of {base}; "
              f"per round {min(ratios):.2f}-{max(ratios):.2f}); greedy output "
              f"{'equals' if outputs[name] == outputs[base] else 'differs from'} {base}'s")


if __name__ == "__main__":
    main()
