"""Compare drafters (DFlash and DFlash2) for one target on the held-out prompts (docs/drafters.md, DFlash2 table).

    .venv/bin/python tools/compare_drafters.py --draft dflash=DIR1 --draft dflash2=DIR2              # T = 0
    .venv/bin/python tools/compare_drafters.py --draft dflash=DIR1 --draft dflash2=DIR2 --temperature 1 --seeds 2 \
        --max-new-tokens 128

Runs every drafter through ``training/evaluation.py`` (the serving runtime's ``Session``, as ``dflash-trt eval``;
a DFlash2 drafter proposes with its candidate selector), interleaved prompt by prompt with plain decoding of
the same prompts so a busy machine slows all of them alike, and prints one JSON object per drafter: τ per
cycle and per prompt, per-position acceptance, the mean draft and verify forward at the full block (the
session's cost model, measured in this traffic), and at T = 0 the speed-up over plain decoding (wall seconds
of the generations; the outputs are checked equal). Default target: the embedded stories260K; default
prompts: the 21 held-out TinyStories first sentences. One torch thread.
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint
from dflash_trt.formats.load import load_pair
from dflash_trt.training.prompts import heldout_prompts_path, read_prompts
from dflash_trt.training.evaluation import compare_drafters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", action="append", required=True, help="NAME=DIR (repeat)")
    parser.add_argument("--target", help="target checkpoint (default: the embedded stories260K)")
    parser.add_argument("--prompts", help="prompt file (default: the held-out TinyStories)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--proposal", choices=["greedy", "sampled"], default="sampled")
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.target, None)
    drafters = {}
    for item in args.draft:
        name, _, folder = item.partition("=")
        drafters[name] = load_draft_checkpoint(folder).eval()
    texts = read_prompts(args.prompts or heldout_prompts_path())
    prompts = [pair.tokenizer.encode(text) for text in texts]
    prompts = [p for p in prompts if len(p) + args.max_new_tokens <= pair.target.config.max_position_embeddings]
    rows = compare_drafters(pair.target.eval(), drafters, prompts, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, proposal=args.proposal, seeds=args.seeds)
    for row in rows:
        print(json.dumps({"temperature": args.temperature, "proposal": args.proposal, "prompts": len(prompts),
                          **row.to_dict()}))


if __name__ == "__main__":
    main()
