"""Regenerate the README's measured figures: the default `hetfed run`'s table and time, and the suite's size.

The README keeps them between marker comments, so a figure there is always one this script wrote, with the
date and commit it was measured at. tests/test_readme_figures.py compares them with a fresh run and a fresh
collection, so a change that moves them fails until this script is run again.

    python scripts/readme_figures.py              # one timed `hetfed run`, one `pytest --collect-only`
    python scripts/readme_figures.py --count      # the suite's size only (after adding or removing tests)
    python scripts/readme_figures.py --readme X   # write another copy of the README instead

Run it on an otherwise idle machine: the time is one run's wall clock, as a process, like `/usr/bin/time`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_BLOCK = "default-run"
COUNT_BLOCK = "test-count"
# The table's column that depends on the machine's speed.
TIME_COLUMN = "time"
# The columns that depend on the machine's arithmetic. On one machine the seed fixes them (tests/e2e/
# test_repeatable.py), but PyTorch's CPU kernels sum in an order that depends on the processor (AVX2 or
# AVX-512, and the BLAS kernels chosen for it), so another machine's run lands a few tenths of a point away:
# the default run gave 95.00 % and 72.20 % on an AVX-512 machine, 94.70 % and 73.25 % on another. Compared within
# ACCURACY_TOLERANCE_POINTS percentage points, as the golden test compares its accuracies (within 3).
ACCURACY_COLUMNS = ("own-test acc", "global-test acc")
ACCURACY_TOLERANCE_POINTS = 2.0
COLLECTED = re.compile(r"^(\d+)(?:/\d+)? tests? collected", re.MULTILINE)


def markers(name: str) -> tuple[str, str]:
    """The comments that open and close the generated block ``name``."""
    return (f"<!-- readme_figures.py {name}: begin -->", f"<!-- readme_figures.py {name}: end -->")


def block(text: str, name: str) -> str:
    """What the README holds between the markers of ``name`` (ValueError when they are missing)."""
    begin, end = markers(name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"the README has no {begin} ... {end} block")
    return text[start + len(begin):stop]


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` holding ``body``."""
    begin, end = markers(name)
    old = block(text, name)
    return text.replace(begin + old + end, begin + body + end, 1)


def hetfed_command() -> list[str]:
    """`hetfed` as this interpreter runs it (the entry point's module: the same process, on the same path)."""
    return [sys.executable, "-m", "hetfed.cli"]


def run_table(output: str) -> str:
    """The final table of `hetfed run`'s output: from its header to the end, lines right-stripped."""
    lines = [line.rstrip() for line in output.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("algorithm ")]
    if not starts:
        raise ValueError("no table in hetfed run's output:\n" + output[-2000:])
    return "\n".join(line for line in lines[starts[-1]:] if line)


def table_rows(table: str) -> list[dict[str, str]]:
    """The rows of a `hetfed run` table as {column: value}, the ruler left out."""
    lines = [line for line in table.strip().splitlines() if line.strip() and not set(line.strip()) <= {"─", "-"}]
    header = re.split(r"\s{2,}", lines[0].strip())
    return [dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=True)) for line in lines[1:]]


def fixed_columns(table: str) -> list[dict[str, str]]:
    """The rows without the columns that depend on the machine (its speed, its arithmetic)."""
    return [{k: v for k, v in row.items() if k != TIME_COLUMN and k not in ACCURACY_COLUMNS}
            for row in table_rows(table)]


def percent(value: str) -> float:
    """A table's "94.70%" as 94.7."""
    return float(value.rstrip("%"))


def accuracy_differences(fresh: str, readme: str) -> list[str]:
    """The accuracies of ``fresh`` more than ACCURACY_TOLERANCE_POINTS from the README's, one line each (the
    rows matched by their algorithm; a row missing on either side is a difference too)."""
    old = {row["algorithm"]: row for row in table_rows(readme)}
    new = {row["algorithm"]: row for row in table_rows(fresh)}
    out = [f"{name}: only in {'the README' if name in old else 'the fresh run'}" for name in sorted(set(old) ^ set(new))]
    for name in sorted(set(old) & set(new)):
        for column in ACCURACY_COLUMNS:
            a, b = percent(old[name][column]), percent(new[name][column])
            if abs(a - b) > ACCURACY_TOLERANCE_POINTS:
                out.append(f"{name} {column}: README {a:.2f}%, fresh run {b:.2f}%")
    return out


def default_run() -> tuple[str, float]:
    """The default `hetfed run`'s table and its wall-clock seconds as a process."""
    with tempfile.TemporaryDirectory() as cwd:
        start = time.perf_counter()
        proc = subprocess.run([*hetfed_command(), "run"], cwd=cwd, capture_output=True, text=True, timeout=1800)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"hetfed run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return run_table(proc.stdout), seconds


def collected_count() -> int:
    """How many tests the default suite runs: `pytest --collect-only -q`, slow tests deselected as pyproject says."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    found = COLLECTED.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"pytest --collect-only failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return int(found[-1])


def readme_count(text: str) -> int:
    """The suite's size the README states."""
    return int(block(text, COUNT_BLOCK).strip().replace(",", ""))


def commit() -> str:
    """The short commit measured, marked when the work tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.strip()
    return f"{head} with uncommitted changes" if dirty else head


def run_body(table: str, seconds: float) -> str:
    """The generated block of the default run: its table and one timing with date, commit and machine."""
    today = dt.datetime.now(dt.UTC).date().isoformat()
    load = os.getloadavg()[0]
    sentence = (f"Measured by `python scripts/readme_figures.py` on {today} at {commit()}: the command took "
                f"{seconds:.1f} s on {os.cpu_count()} CPU cores (load average {load:.1f} at the end).")
    return f"\n```\n{table}\n```\n\n{textwrap.fill(sentence, width=110, break_on_hyphens=False)}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", action="store_true", help="refresh the suite's size only (no hetfed run)")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md", help="the file to rewrite")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    if not args.count:
        table, seconds = default_run()
        text = replace_block(text, RUN_BLOCK, run_body(table, seconds))
        print(f"default run: {seconds:.1f} s\n{table}")
    count = collected_count()
    text = replace_block(text, COUNT_BLOCK, f"{count:,}")
    print(f"tests collected: {count:,}")
    args.readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
