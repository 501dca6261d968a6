"""What a plain step costs in an adaptive session, for plain requests and for requests that asked to draft
(docs/adaptive-notebook.md, "Waiting for a guess").

One ``speculation auto`` session serves waves of the same prompts, alternating (A B, B A, ...) a wave of plain
requests (``block_len`` 1) and a wave of drafting ones (the engine's block). For each wave it prints the median of its
steps at the full batch in which nothing drafted: their time and their verify forward's, how many there were, how
many still had a request keeping its drafter (not retired: its verify rows hand over context taps), and how many
steps drafted. Timed by a step subscriber, outside the loop::

    python tools/plain_steps_ab.py --engine /tmp/eng_final --batch 16 --waves 8
"""

from __future__ import annotations

import argparse
import statistics

from dflash_trt.bench.datasets import load_dataset
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.policy import SpeculationConfig
from dflash_trt.runtime.session import Session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--waves", type=int, default=8, help="waves per mode")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    session = Session.load(args.engine, max_batch=args.batch, speculation=SpeculationConfig(mode="auto"))
    steps: list[tuple[float, float, int, int, bool]] = []  # seconds, verify seconds, rows, drafting rows, taps kept
    session._scheduler.subscribe(lambda r: steps.append(
        (r.seconds, r.verify_s, len(r.rows), sum(1 for d in r.drafted if d), any(s.uses_drafter for s in r.rows))),
        timed=True)
    prompts = [session.encode(p.text) for p in load_dataset("tinystories_prefixes").prompts[:args.batch]]
    modes = {"plain": 1, "drafting": session.default_block_len}
    medians: dict[str, list[float]] = {name: [] for name in modes}
    for wave in range(2 * args.waves):
        name = list(modes)[wave % 2 if wave // 2 % 2 == 0 else 1 - wave % 2]
        steps.clear()
        params = SamplingParams(max_new_tokens=args.max_new_tokens, block_len=modes[name])
        for handle in [session.submit(p, params) for p in prompts]:
            handle.result()
        plain = [s for s in steps if s[2] == args.batch and s[3] == 0]
        drafted = sum(1 for s in steps if s[3])
        if not plain:
            print(f"{name:>8}: no plain step at batch {args.batch} ({drafted} drafting steps)")
            continue
        step_ms = statistics.median(s[0] for s in plain) * 1e3
        medians[name].append(step_ms)
        print(f"{name:>8}: plain step {step_ms:.3f} ms (verify {statistics.median(s[1] for s in plain) * 1e3:.3f}) "
              f"over {len(plain)} steps, {sum(1 for s in plain if s[4])} keeping a drafter; {drafted} drafting steps")
    for name, values in medians.items():
        if values:
            print(f"{name:>8}: median over waves {statistics.median(values):.3f} ms")


if __name__ == "__main__":
    main()
