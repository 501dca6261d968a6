"""How much this machine's own speed moves: the noise floor of any A/B measured on it.

Times one fixed piece of work (a float32 matmul loop on one thread) back to back for ``--seconds`` and prints its
speed per ``--window`` seconds, then the ratio of each window's speed to the next one's: what a benchmark that
alternates two *identical* modes window by window would report as their "speed-up". A benchmark's ratio between
two modes can be told apart from 1.0 only beyond that spread (docs/adaptive-notebook.md, "Plain decoding's price while
drafting")::

    python tools/machine_noise.py --seconds 30 --window 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def measure(seconds: float, window: float, size: int = 256, calls: int = 50) -> list[float]:
    """Work units per second in each ``window`` of ``seconds`` (a unit: ``calls`` matmuls of ``size`` x ``size``)."""
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    rates: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        start, units = time.perf_counter(), 0
        while time.perf_counter() - start < window:
            for _ in range(calls):
                a @ b
            units += 1
        rates.append(units / (time.perf_counter() - start))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to measure")
    parser.add_argument("--window", type=float, default=1.0, help="seconds per speed reading (about a bench pass)")
    args = parser.parse_args(argv)
    rates = measure(args.seconds, args.window)
    if len(rates) < 3:
        parser.error(f"--seconds {args.seconds:g} gives {len(rates)} windows of {args.window:g} s; expected at least "
                     "3. Fix: measure longer or use a shorter --window.")
    median = statistics.median(rates)
    relative = [rate / median for rate in rates]
    pairs = [a / b for a, b in zip(rates, rates[1:])]
    deciles = statistics.quantiles(pairs, n=10)
    print(f"{len(rates)} windows of {args.window:g} s, speed relative to their median: min {min(relative):.2f}, "
          f"max {max(relative):.2f}")
    print("one window over the next (identical work): "
          f"p10 {deciles[0]:.2f}, median {statistics.median(pairs):.2f}, p90 {deciles[-1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
