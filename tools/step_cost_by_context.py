"""How a decode step's cost grows with the context on an engine's backend (docs/benchmarks.md, context scaling).

Fills cache slots to each context, then times single-token target forwards (a plain decode step) at each
context, interleaved round by round so drift hits every context alike, and prints the median per context and
its ratio to the shortest (the engine must be built with ``--max-batch-size`` >= batch x contexts). Wall time of
the forward only (``Backend.target_batch``), on the backend ``Session.load`` picks (or ``--backend``)::

    python tools/step_cost_by_context.py --engine engines/stories260K --contexts 32,448 --batch 1,16
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash_trt.plugins.interface import TargetRow
from dflash_trt.runtime.session import Session


def measure(session: Session, contexts: list[int], batch: int, rounds: int, steps: int) -> dict[int, float]:
    """Median seconds of one decode step (``batch`` rows, one token each) per context. Context ``i`` owns the
    consecutive slots ``i*batch ..`` filled to that context; each step is cropped back, so all stay put."""
    backend = session.backend
    groups = {context: list(range(index * batch, (index + 1) * batch)) for index, context in enumerate(contexts)}
    for context, slots in groups.items():
        for slot in slots:
            backend.reset_slot(slot)
        backend.target_batch([TargetRow(slot, [1] * context, 0, last_only=True) for slot in slots], False)
    samples: dict[int, list[float]] = {context: [] for context in contexts}
    for _ in range(rounds):
        for context, slots in groups.items():
            rows = [TargetRow(slot, [5], context) for slot in slots]
            for _ in range(steps):
                began = time.perf_counter()
                backend.target_batch(rows, False)
                samples[context].append(time.perf_counter() - began)
                for slot in slots:  # drop the row just written: the next step runs at the same context
                    backend.crop_target_slot(slot, context)
    return {context: statistics.median(values) for context, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="engine folder from `dflash-trt build`")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--contexts", default="32,448", help="comma-separated context lengths")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes (rows per step)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="steps per context per round")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    slots = max(batches) * len(contexts)
    with Session.load(args.engine, args.backend, max_batch=slots, max_seq_len=max(contexts) + 2) as session:
        print(f"engine {args.engine}, backend {session.backend.name}, {args.rounds} rounds x {args.steps} steps")
        for batch in batches:
            medians = measure(session, contexts, batch, args.rounds, args.steps)
            base = medians[contexts[0]]
            cells = ", ".join(f"context {c}: {m * 1e3:.3f} ms ({m / base:.2f}x)" for c, m in medians.items())
            print(f"batch {batch}: {cells}")


if __name__ == "__main__":
    main()
