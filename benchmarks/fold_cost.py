"""What folding one update into the round's aggregate costs: a running float64 sum in arrival order (the fold
before the sums were made order-independent) against ``WeightedMean`` on ``ExactSum`` (the same bits in any
order of arrival).

    python benchmarks/fold_cost.py [--million 1] [--repeat 20]

Every figure is CPU time of this thread (``time.thread_time``), the median of ``--repeat`` runs after one
warm-up: it does not count the time the thread waits for a core, so it holds on a busy machine. The update is
``--million`` million float32 values (a model of that many parameters) of a standard normal, weight 37.
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

# The same timer as the digest's cost (this folder is first on sys.path when run).
from digest_cost import cpu_ms

from hetfed.aggregator.algorithms.aggregators import ExactSum, WeightedMean

BLOCK = 1 << 16


class RunningSum:
    """The fold before: weight × values added to a float64 running sum a block at a time, in arrival order."""

    def __init__(self, size: int) -> None:
        self.sum = np.zeros(size, np.float64)
        self.scratch = np.empty(min(BLOCK, size), np.float64)

    def add(self, flat: np.ndarray, weight: float) -> None:
        for lo in range(0, flat.size, BLOCK):
            part = self.scratch[:min(BLOCK, flat.size - lo)]
            np.multiply(flat[lo:lo + part.size], weight, out=part, dtype=np.float64)
            self.sum[lo:lo + part.size] += part

    def mean(self, weight: float) -> np.ndarray:
        return np.divide(self.sum, weight, out=np.empty(self.sum.shape, np.float32), casting="unsafe")


def main(argv: list[str] | None = None) -> int:
    """Time each fold's add, first add and close, and print a Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--million", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    n = int(args.million * 1e6)
    update = {"w": np.random.default_rng(0).standard_normal(n).astype(np.float32)}
    flat = update["w"]

    before = RunningSum(n)
    after = WeightedMean()
    after.add(update, 37.0)

    def first_add() -> None:  # a fresh sum: every element's window is set, its levels' pages touched
        WeightedMean().add(update, 37.0)

    def first_add_before() -> None:  # a fresh running sum: its pages touched
        RunningSum(n).add(flat, 37.0)

    rows = [
        ("add, running float64 sum (before)", cpu_ms(lambda: before.add(flat, 37.0), args.repeat), "8"),
        ("add, WeightedMean on ExactSum (after)", cpu_ms(lambda: after.add(update, 37.0), args.repeat),
         f"{8 * ExactSum.K + 1}"),
        ("first add of a round (before)", cpu_ms(first_add_before, max(3, args.repeat // 4)), ""),
        ("first add of a round (after)", cpu_ms(first_add, max(3, args.repeat // 4)), ""),
        ("close: mean as float32 (before)", cpu_ms(lambda: before.mean(37.0), args.repeat), ""),
        ("close: mean as float32 (after)", cpu_ms(lambda: after.mean(np.float32), args.repeat), ""),
    ]
    print(f"{args.million:g}M float32 values, median of {args.repeat}; numpy {np.__version__}, "
          f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}")
    print()
    print("| step | CPU ms | bytes of state per value |")
    print("|---|---:|---:|")
    for name, ms, state in rows:
        print(f"| {name} | {ms:.2f} | {state} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
