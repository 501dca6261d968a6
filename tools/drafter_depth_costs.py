"""What a 1-, 2- or 3-layer drafter costs per cycle on this machine, and the speed-up that implies at its τ.

A drafter's cost does not depend on its weights, so the 1- and 2-layer drafters here are untrained copies of
the shipped drafter's configuration with fewer layers (same width 512, taps 1, 3, 4, B = 16); the 3-layer one
is the shipped drafter. One session per depth over the same embedded target; the sessions run the same
prompts interleaved (plain decoding and block length 16, request by request), and each session's cost model
(``Session.costs``: the mean of every forward of each kind after a warm-up round) gives the plain step and the cycle.
τ per cycle comes from ``docs/drafters.md`` (held-out TinyStories, 1,500 training steps; 6,000 for the shipped one),
since an untrained drafter accepts nothing.

    OMP_NUM_THREADS=1 .venv/bin/python tools/drafter_depth_costs.py [--concurrency 1] [--rounds 6]

``DFLASH_TORCH_COMPILE`` picks the torch backend's execution as for every session.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from dflash_trt.bench.datasets import load_dataset
from dflash_trt.formats.load import load_pair
from dflash_trt.config import SamplingParams
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.runtime.session import Session

TAU_PER_CYCLE = {1: 2.55, 2: 3.14, 3: 3.54}
"""docs/drafters.md, "Block length × draft layers", B = 16 at 1,500 steps (the shipped 3-layer drafter: 4.96)."""
SHIPPED_TAU = 4.96


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6, help="passes over the prompts, sessions interleaved")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(None, None)
    sessions = {}
    for layers in (1, 2, 3):
        draft = pair.draft
        if layers != draft.config.num_layers:
            config = draft.config.model_copy(update={"num_layers": layers, "layer_sliding": (False,) * layers})
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(layers)
                draft = DraftHead(config, draft.rotary.cos.shape[0] - 1).eval()
        sessions[layers] = Session(dataclasses.replace(pair, draft=draft), max_batch=args.concurrency)
    prompts = [p.text for p in load_dataset("tinystories").prompts[:args.concurrency * 2]]
    marks = {}
    for round_number in range(args.rounds + 1):  # round 0 warms up
        if round_number == 1:
            marks = {layers: session.costs.mark() for layers, session in sessions.items()}
        for block_len in (1, 16):
            for session in sessions.values():
                params = SamplingParams(max_new_tokens=args.max_new_tokens, block_len=block_len)
                for start in range(0, len(prompts), args.concurrency):
                    handles = [session.submit(p, params) for p in prompts[start:start + args.concurrency]]
                    for handle in handles:
                        handle.result()
    print(f"concurrency {args.concurrency}, torch backend {sessions[3].backend.execution}, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds; ms, means over the rounds")
    print("| draft layers | plain step | verify(16) | draft(16) | other | cycle | τ per cycle | ideal speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for layers, session in sessions.items():
        costs = session.costs.breakdown(args.concurrency, 15, since=marks[layers])
        taus = [(TAU_PER_CYCLE[layers], "1,500 steps")] + ([(SHIPPED_TAU, "shipped")] if layers == 3 else [])
        for tau, note in taus:
            print(f"| {layers} ({note}) | {costs.plain_step * 1e3:.2f} | {costs.verify * 1e3:.2f} | "
                  f"{costs.draft * 1e3:.2f} | {costs.draft_other * 1e3:.2f} | {costs.cycle * 1e3:.2f} | {tau:.2f} | "
                  f"{costs.ideal_speedup(tau):.2f}x |")
    for session in sessions.values():
        session.close()


if __name__ == "__main__":
    main()
