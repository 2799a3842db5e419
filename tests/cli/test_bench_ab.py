"""scripts/bench_ab.py's safeguards: the trees it measures are real checkouts, and each tree's processes load
that tree's packages (an editable install must not win over them)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench_ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_ab", REPO / "scripts" / "bench_ab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_worktree_of_head_holds_its_packages_and_is_removed_afterwards() -> None:
    ab = bench_ab()
    with ab.worktree("HEAD") as tree:
        assert (tree / "services/hetfed/aggregator/config.py").exists()
        ab.check_tree(tree)  # its packages load from it, not from this checkout
        kept = tree
    assert not kept.exists()
    listed = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(kept) not in listed


def test_a_tree_without_the_packages_is_refused(tmp_path: Path) -> None:
    # An empty tree puts nothing on the path: the packages would load from elsewhere, so nothing is measured.
    with pytest.raises(SystemExit, match="load from elsewhere"):
        bench_ab().check_tree(tmp_path)


def test_the_environment_puts_the_tree_first() -> None:
    env = bench_ab().tree_env(Path("/somewhere"))
    assert env["PYTHONPATH"].split(":")[:3] == ["/somewhere/proto", "/somewhere/services", "/somewhere/clients"]


def test_ratios_pair_runs_in_order_and_skip_a_figure_a_harness_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    head = [[{"clients": 4, "a": 2.0, "b": 9.0}], [{"clients": 4, "a": 3.0, "b": 9.0}]]
    base = [[{"clients": 4, "a": 1.0, "x": 3.0}], [{"clients": 4, "a": 4.0, "x": 3.0}]]
    ratios = bench_ab().print_ratios(head, base, ["4"], [("a", "a", "A"), ("b", "x", "B against X"), ("c", "c", "C")])
    assert ratios == {"N=4": {"a": [2.0, 0.75], "b": [3.0, 3.0]}}  # pairs in order; "c" is in neither harness
    assert "1.375 (0.750-2.000)" in capsys.readouterr().out  # the median of the two pairs and their range
