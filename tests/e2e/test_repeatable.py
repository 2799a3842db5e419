"""One seed fixes the result: ``hetfed run`` twice with the same arguments writes the same figures, to the bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

# What a run measures of the machine rather than of the federation: its timings. A long-poll that expires before
# its round closes is answered WAIT and counted in the metrics only, so every byte of the table is compared.
TIMINGS = frozenset({"wall_seconds", "duration_seconds"})


def figures(value: Any) -> Any:
    """results.json without what depends on the machine's timing."""
    if isinstance(value, dict):
        return {k: figures(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [figures(v) for v in value]
    return value


def run_twice(tmp_path: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    got = []
    for name in ("first", "second"):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", *args, "--no-report", "--output", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results = json.loads((out / "results.json").read_text())
        results["options"].pop("output")
        got.append({r["algorithm"]: figures(r) for r in results["runs"]} | {"options": results["options"]})
    return got[0], got[1]


def test_the_default_comparison_and_fedcma_repeat_to_the_bit(tmp_path: Path) -> None:
    first, second = run_twice(tmp_path, "--algorithm", "fedavg,local,fedcma", "--clients", "3", "--rounds", "3",
                              "--dataset", "digits", "--model", "mlp", "--partition", "dirichlet", "--alpha", "0.5",
                              "--seed", "3")
    assert set(first) == {"fedavg", "local", "fedcma", "options"}
    for algorithm in ("fedavg", "local", "fedcma"):
        rounds = first[algorithm]["rounds"]
        assert len(rounds) == 4 + (algorithm == "fedcma")  # the setup round, three training rounds, evaluation
        assert first[algorithm] == second[algorithm], algorithm
        # Every organization's figures of every round, not only the summary, are compared, and payload bytes.
        assert all(r["per_organization"] for r in rounds if r["round"] >= 1)
        assert algorithm == "local" or any(set(r["bytes_up"]) - {"eval_metrics"} for r in rounds)
