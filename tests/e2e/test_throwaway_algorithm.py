"""An algorithm added outside hetfed through exactly the documented path runs end to end.

``tests/throwaway`` holds a spec, a numpy server half and a torch client half (docs/algorithms/adding.md);
``HETFED_ALGORITHMS`` registers the spec in every process ``hetfed run`` starts. Nothing else is edited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _env(register: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    env.pop("HETFED_ALGORITHMS", None)
    if register:
        env["HETFED_ALGORITHMS"] = "tests.throwaway.spec:SPEC"
    return env


def _run(tmp_path: Path, register: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "throwaway_shrink", "--dataset", "gauss4",
         "--clients", "2", "--rounds", "2", "--local-epochs", "1", "--set", "throwaway_shrink.shrink=0",
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=_env(register), cwd=tmp_path)


def test_a_throwaway_algorithm_registered_by_one_line_runs_end_to_end(tmp_path: Path) -> None:
    proc = _run(tmp_path, register=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = next(r for r in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
               if r["algorithm"] == "throwaway_shrink")
    rounds = {r["round"]: r for r in run["rounds"]}
    # Round 1: no global head yet (-1); round 2: the server half's mean of the heads times shrink = 0.
    assert {o["received_head_norm"] for o in rounds[1]["per_organization"].values()} == {-1.0}
    assert {o["received_head_norm"] for o in rounds[2]["per_organization"].values()} == {0.0}
    assert "head_weights" in rounds[1]["bytes_up"] and "head_weights" in rounds[2]["bytes_down"]
    assert "head_weights" not in rounds[1]["bytes_down"]
    # The spec's figure reaches the results under its key; with no label on the experiment side, the key is shown.
    assert run["final_figures"] == {"received": 0.0}
    assert run["figure_labels"] == {"received": "received"}


def test_without_the_registration_the_name_is_unknown(tmp_path: Path) -> None:
    proc = _run(tmp_path, register=False)
    assert proc.returncode != 0
    assert "throwaway_shrink" in proc.stderr
