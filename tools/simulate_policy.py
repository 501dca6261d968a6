"""The adaptive speculation policy on simulated machines: record acceptance traces, write the table.

    python tools/simulate_policy.py record --out dflash_trt/bench/data/acceptance_traces.json
    python tools/simulate_policy.py table --out docs/adaptive.md
    python tools/simulate_policy.py mixed --regime cpu --concurrency 16 --workload stories_t0 --seeds 0,1,2
    python tools/simulate_policy.py by-start
    python tools/simulate_policy.py switch --regime h200-1k --concurrency 64 --first untrained --then stories_t0
    python tools/simulate_policy.py bench --regime cpu --concurrency 16 --workload stories_t0 --seeds 0,1,2,3,4,5
    python tools/simulate_policy.py bench --regime cpu-torch --concurrency 16 --offset 0 --seeds 0,1,2,3,4,5

``record`` serves shipped prompt sets on the embedded stories260K pair (torch backend, static speculation,
the whole block) and stores each request's per-cycle accepted drafts, plus two synthetic workloads.
``table`` runs the unchanged scheduler and policy on the simulated backend (``dflash_trt/bench/simulate.py``)
for every regime x concurrency x workload and writes the ratios to a markdown file between markers (the rest
of the file is kept). ``mixed`` runs one cell on a workload of mixed lengths (``acceptance_traces.mixed_lengths``:
every 4th request six recorded responses long), 2 requests per slot, and prints each policy's speed over plain
decoding per seed: where the batch shrinks with long requests left. ``by-start`` prints, per shipped workload, the
tokens a cycle commits by where in its response it starts (tokens 0-15, 16-31, 32-127): what a probe made there reads.
``switch`` serves one workload's requests (2 per slot), then another's (6 per slot; 32 requests at least), and
prints each policy's speed over plain decoding per seed: whether the session notices that its workload changed.
``bench`` serves one cell shaped as the real-run bench command serves it (``dflash-trt bench --num-prompts 32
--max-new-tokens 128``: 32 requests, each cut at 128 tokens, so a wave of them ends together under plain decoding)
and prints the same per seed; with ``--offset 0`` on ``stories_t0`` its requests are the bench's own (its 32
``tinystories_prefixes`` prompts, in order), and only the seed's noise and load bursts differ; with ``--breakdown``
it prints where auto's time went, by the planner's reason and whether the batch was full.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dflash_trt.bench import acceptance_traces as traces

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- simulate_policy: begin -->", "<!-- simulate_policy: end -->"


def record(out: Path) -> None:
    command = "python tools/simulate_policy.py record --out " + str(out)
    workloads = {
        "stories_t0": traces.record("stories_t0", "held-out TinyStories prefixes, greedy (T=0): in domain",
                                    "tinystories_prefixes", 0.0, 84, 128),
        "stories_t1": traces.record("stories_t1", "held-out TinyStories prefixes, sampled (T=1): in domain",
                                    "tinystories_prefixes", 1.0, 84, 128),
        "spec_bench_t0": traces.record("spec_bench_t0", "Spec-Bench first turns (code, math, chat through a "
                                       "story vocabulary), greedy: out of domain", "spec_bench", 0.0, 64, 128),
    }
    lengths = list(workloads["stories_t0"].prompt_lengths)
    workloads["untrained"] = traces.synthetic(
        "untrained", "synthetic: an untrained drafter (position 1 accepted 1% of the time, 10% after that), "
        "tau ~1.01", [0.01] + [0.1] * 14, lengths, 128, seed=1)
    workloads["ood_synthetic"] = traces.synthetic(
        "ood_synthetic", "synthetic: a drafter out of its domain (alpha 0.45 at every position), tau ~1.8",
        [0.45] * 15, lengths, 128, seed=2)
    traces.save(out, workloads, command)
    for name, w in workloads.items():
        print(f"{name}: {len(w.requests)} requests, tau {w.tau:.2f}")


def _cell(args: tuple) -> object:
    from dflash_trt.bench import simulate

    regime, concurrency, workload, seed, requests_per_slot = args
    return simulate.cell(regime, concurrency, traces.load()[workload], seed=seed, requests_per_slot=requests_per_slot)


def table(out: Path, seed: int, requests_per_slot: int, jobs: int) -> None:
    from concurrent.futures import ProcessPoolExecutor

    from dflash_trt.bench import simulate
    from dflash_trt.bench.sim_regimes import REGIMES

    began = time.perf_counter()
    cells = [(r, c, w, seed, requests_per_slot) for r in REGIMES for c in simulate.CONCURRENCIES
             for w in simulate.WORKLOADS]
    with ProcessPoolExecutor(jobs) as pool:  # cells are independent and deterministic by seed
        rows = list(pool.map(_cell, cells))
    shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out  # as typed in the repo
    text = simulate.render(rows, seed=seed, requests_per_slot=requests_per_slot,
                           command=f"python tools/simulate_policy.py table --out {shown}"
                                   + (f" --seed {seed}" if seed else "")
                                   + (f" --requests-per-slot {requests_per_slot}" if requests_per_slot != 4 else ""))
    old = out.read_text(encoding="utf-8") if out.is_file() else ""
    if BEGIN in old and END in old:
        text = old[:old.index(BEGIN)] + BEGIN + "\n" + text + END + old[old.index(END) + len(END):]
    else:
        text = old + BEGIN + "\n" + text + END + "\n"
    out.write_text(text, encoding="utf-8")
    print(f"{len(rows)} cells in {time.perf_counter() - began:.1f} s -> {out}")


def mixed(regime: str, concurrency: int, workload: traces.Workload, seeds: list[int], every: int,
          joined: int) -> None:
    long_and_short = traces.mixed_lengths(workload, every, joined)
    print(f"{regime}, c={concurrency}, {long_and_short.description}, 2 requests per slot: tokens/s over plain decoding")
    _per_seed(regime, concurrency, long_and_short, seeds, requests_per_slot=2)


def switch(regime: str, concurrency: int, first: traces.Workload, then: traces.Workload, seeds: list[int]) -> None:
    from dflash_trt.bench import simulate

    total = max(simulate.MIN_REQUESTS, 8 * concurrency)  # what a cell of 8 requests per slot serves
    workload = traces.switched(first, then, total // 4, total - total // 4)
    print(f"{regime}, c={concurrency}, {workload.description}: tokens/s over plain decoding")
    # served from the first request on, so the change comes after the first workload's requests
    _per_seed(regime, concurrency, workload, seeds, requests_per_slot=8, offset=0)


def bench(regime: str, concurrency: int, workload: traces.Workload, seeds: list[int], requests: int,
          max_new_tokens: int, offset: int | None = None, breakdown: bool = False) -> None:
    from dflash_trt.bench import simulate

    options = bench_options(concurrency, requests, max_new_tokens) | {"offset": offset}
    served = max(simulate.MIN_REQUESTS, options["requests_per_slot"] * concurrency)
    print(f"{regime}, c={concurrency}, {served} requests of {workload.name}, each cut at {max_new_tokens} tokens: "
          "tokens/s over plain decoding")
    _per_seed(regime, concurrency, workload, seeds, breakdown=breakdown, **options)


def bench_options(concurrency: int, requests: int, max_new_tokens: int) -> dict[str, int]:
    """``simulate.cell``'s options for ``requests`` requests (rounded up to a multiple of ``concurrency``, at least
    ``simulate.MIN_REQUESTS``) of ``max_new_tokens`` tokens each: the first comes from the prefill, so the cycles cover
    the other ``max_new_tokens - 1``."""
    return {"requests_per_slot": -(-requests // concurrency), "max_tokens": max_new_tokens - 1}


def _per_seed(regime: str, concurrency: int, workload: traces.Workload, seeds: list[int], breakdown: bool = False,
              **cell_options) -> None:
    """One line per seed: each static length's and auto's tokens/s over plain decoding (``simulate.cell``); with
    ``breakdown``, then where auto's time went (``simulate.breakdown``)."""
    from dflash_trt.bench import simulate

    for seed in seeds:
        steps: list[tuple[str, int, int, float]] = []  # auto's, for the breakdown
        cell = simulate.cell(regime, concurrency, workload, seed=seed, **cell_options, steps=steps,
                             policies=("plain", *(f"static:{k}" for k in simulate.STATIC_LENGTHS), "auto"))
        statics = "  ".join(f"{p} {cell.ratio(p):.3f}x" for p in cell.results if p.startswith("static:"))
        print(f"seed {seed}: {statics}  auto {cell.ratio('auto'):.3f}x ({cell.ratio('auto') / cell.best_fixed:.2f} of "
              f"the best fixed choice)")
        if breakdown:  # where auto's time went, against plain decoding's rate in the cell
            plain = cell.results["plain"]
            print("\n".join(simulate.breakdown(steps, concurrency, plain.tokens / plain.seconds,
                                               " against plain decoding's rate")))


def by_start() -> None:
    starts, end = (0, 16, 32), 128
    ranges = [f"{a}-{b - 1}" for a, b in zip(starts, [*starts[1:], end])]
    print(f"tokens committed per cycle, by the output token it starts at ({', '.join(ranges)}):")
    for name, workload in traces.load().items():
        means = workload.tokens_per_cycle_by_start(starts, end)
        print(f"  {name}: " + ", ".join("-" if m is None else f"{m:.2f}" for m in means))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer; expected 1 or more")
    return int(text)


def _offset(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a request index; expected 0 or more")
    return int(text)


def _new_tokens(text: str) -> int:
    """A request's length in tokens: the first comes from the prefill, so at least one more must be decoded."""
    if text.isdigit() and int(text) < 2:
        raise argparse.ArgumentTypeError(f"{text} leaves nothing to decode after the prefill's token; "
                                         "expected 2 or more")
    return _positive(text)


def _seeds(text: str) -> list[int]:
    parts = text.split(",")
    if not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers; expected e.g. 0,1,2")
    return [int(part) for part in parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record acceptance traces on the embedded pair")
    rec.add_argument("--out", type=Path, default=ROOT / "dflash_trt" / "bench" / "data" / traces.SHIPPED)
    tab = sub.add_parser("table", help="simulate every cell and write the table")
    tab.add_argument("--out", type=Path, default=ROOT / "docs" / "adaptive.md")
    tab.add_argument("--seed", type=int, default=0)
    tab.add_argument("--requests-per-slot", type=int, default=4)
    tab.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (cells run in parallel)")
    from dflash_trt.bench.sim_regimes import REGIMES

    mix = sub.add_parser("mixed", help="one cell on a workload of mixed lengths, per seed")
    mix.add_argument("--regime", default="cpu", choices=list(REGIMES))
    mix.add_argument("--concurrency", type=_positive, default=16)
    mix.add_argument("--workload", default="stories_t0", help="a workload of the shipped traces")
    mix.add_argument("--seeds", type=_seeds, default="0,1,2", help="comma-separated integers")
    mix.add_argument("--every", type=_positive, default=4, help="one request in this many is long")
    mix.add_argument("--joined", type=_positive, default=6, help="recorded responses a long request is made of")
    sub.add_parser("by-start", help="tokens a cycle commits by where in its response it starts, per workload")
    swi = sub.add_parser("switch", help="one workload's requests, then another's: does the session notice?")
    swi.add_argument("--regime", default="h200-1k", choices=list(REGIMES))
    swi.add_argument("--concurrency", type=_positive, default=64)
    swi.add_argument("--first", default="untrained", help="a workload of the shipped traces, served first")
    swi.add_argument("--then", default="stories_t0", help="a workload of the shipped traces, served after it")
    swi.add_argument("--seeds", type=_seeds, default="0,1,2", help="comma-separated integers")
    ben = sub.add_parser("bench", help="one cell shaped as the real-run bench command serves it, per seed")
    ben.add_argument("--regime", default="cpu", choices=list(REGIMES))
    ben.add_argument("--concurrency", type=_positive, default=16)
    ben.add_argument("--workload", default="stories_t0", help="a workload of the shipped traces")
    ben.add_argument("--seeds", type=_seeds, default="0,1,2", help="comma-separated integers")
    ben.add_argument("--requests", type=_positive, default=32,
                     help="requests served (the bench's --num-prompts; at least 32, a multiple of the concurrency)")
    ben.add_argument("--max-new-tokens", type=_new_tokens, default=128, help="tokens each request is cut at")
    ben.add_argument("--breakdown", action="store_true",
                     help="after each seed, where auto's time went: its steps by the planner's reason and whether the "
                          "batch was full, against plain decoding's rate")
    ben.add_argument("--offset", type=_offset, default=None,
                     help="the workload's request served first, the rest in order (default: drawn by the seed; 0 on "
                          "stories_t0: the bench's own prompts)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out)
    elif args.command == "table":
        table(args.out, args.seed, args.requests_per_slot, args.jobs)
    elif args.command == "by-start":
        by_start()
    else:  # the traces are read here, not for every command: ``record`` rewrites them
        workloads = traces.load()
        command, names = {"mixed": (mix, ("workload",)), "bench": (ben, ("workload",)),
                           "switch": (swi, ("first", "then"))}[args.command]
        for name in names:
            if getattr(args, name) not in workloads:
                command.error(f"argument --{name}: invalid choice: {getattr(args, name)!r} "
                              f"(choose from {', '.join(workloads)})")
        if args.command == "mixed":
            mixed(args.regime, args.concurrency, workloads[args.workload], args.seeds, args.every, args.joined)
        elif args.command == "bench":
            bench(args.regime, args.concurrency, workloads[args.workload], args.seeds, args.requests,
                  args.max_new_tokens, args.offset, args.breakdown)
        else:
            switch(args.regime, args.concurrency, workloads[args.first], workloads[args.then], args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
