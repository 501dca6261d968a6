"""A draft call of 16 rows, one taking in its prompt: padded into one forward against split into two
(``plugins/interface.py``, ``intake_groups``), interleaved, medians (docs/design.md, the step's draft), on the torch
backend or an ONNX Runtime engine::

    OMP_NUM_THREADS=1 python tools/intake_split.py --context 200
    OMP_NUM_THREADS=1 python tools/intake_split.py --target /tmp/q06/target --draft /tmp/q06/target-dflash-1l \\
        --context 256
    OMP_NUM_THREADS=1 python tools/intake_split.py --engine engines/stories260K --context 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_trt.plugins import interface
from dflash_trt.plugins.interface import DraftRow
from dflash_trt.runtime.session import Session

ROWS = 16
STEADY_CONTEXT = 4  # the new context of a row in steady state: about what a cycle accepts
PAST = 40  # context the steady rows took in before
WARM_UP = 5  # calls each way left out of the medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target checkpoint (default: the embedded stories260K pair)")
    parser.add_argument("--draft", help="drafter checkpoint")
    parser.add_argument("--engine", help="an ONNX Runtime engine folder (`dflash-trt build --backend onnxruntime`) "
                                         "in place of checkpoints")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=40, help="prompt tokens the first row takes in")
    parser.add_argument("--calls", type=int, default=60, help=f"timed calls each way (the first {WARM_UP} left out)")
    args = parser.parse_args(argv)
    if args.calls <= WARM_UP:
        parser.error(f"--calls is {args.calls}; expected more than {WARM_UP} (the first {WARM_UP} are left out)")
    max_seq_len = max(args.context, PAST + STEADY_CONTEXT) + 64
    if args.engine:
        session = Session.load(args.engine, "onnxruntime", max_batch=ROWS, max_seq_len=max_seq_len)
    else:
        session = Session.from_checkpoints(args.target, args.draft, dtype=args.dtype, max_batch=ROWS,
                                           max_seq_len=max_seq_len)
    backend = session.backend
    dim = len(session.pair.draft.config.target_layer_ids) * session.pair.target.config.hidden_size
    block = [5] + [session.pair.draft.config.mask_token_id] * (session.default_block_len - 1)
    dtype = session.pair.target.embed_tokens.weight.dtype
    taps = lambda n: torch.randn(n, dim, dtype=dtype)  # noqa: E731
    backend.draft_batch([DraftRow(slot, block, taps(PAST), PAST) for slot in range(1, ROWS)])
    rows = [DraftRow(0, block, taps(args.context), args.context)] + [
        DraftRow(slot, block, taps(STEADY_CONTEXT), PAST + STEADY_CONTEXT) for slot in range(1, ROWS)]
    split = interface.intake_groups
    times: dict[str, list[float]] = {"one call (padded)": [], "split": []}
    try:
        for call in range(args.calls):
            for way in sorted(times, reverse=bool(call % 2)):
                interface.intake_groups = split if way == "split" else (lambda rs: [list(range(len(rs)))])
                began = time.perf_counter()
                backend.draft_batch(rows)  # each call crops the draft caches back to its rows' starts
                times[way].append(time.perf_counter() - began)
    finally:
        interface.intake_groups = split
        session.close()
    for way, seconds in times.items():
        print(f"{way}: median {statistics.median(seconds[WARM_UP:]) * 1e3:.2f} ms ({ROWS} rows, one taking in "
              f"{args.context} context taps, {'engine ' + args.engine if args.engine else args.dtype}, "
              f"{torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
