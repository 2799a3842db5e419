"""docs/algorithms/README.md is what scripts/algorithm_index.py generates from the registry today."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import algorithm_index  # noqa: E402


def test_the_committed_index_is_a_fresh_generation() -> None:
    committed = algorithm_index.INDEX.read_text()
    assert committed == algorithm_index.render(), f"docs/algorithms/README.md is stale: run {algorithm_index.GENERATOR}"


def test_every_registered_algorithm_has_a_row_that_links_existing_files() -> None:
    from hetfed.wire.specs import REGISTERED

    text = algorithm_index.render()
    for spec in REGISTERED:
        assert sum(line.startswith(f"| `{spec.name}` |") for line in text.splitlines()) == 2, spec.name
    targets = [line.split("](")[i].split(")")[0] for line in text.splitlines() for i in range(1, line.count("](") + 1)]
    missing = [t for t in targets if not (algorithm_index.INDEX.parent / t).exists()]
    assert targets and missing == []
    fedcma = next(line for line in text.splitlines() if line.startswith("| `fedcma` | ["))
    assert "(../../clients/hetfed/client/algorithms/fedcma)" in fedcma and "(fedcma.md)" in fedcma
    assert "fedcma_hetero.bench.toml" in fedcma and "(../../services/hetfed/aggregator/algorithms/fedcma.py)" in fedcma


def test_check_mode_exits_1_on_a_stale_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    index = tmp_path / "README.md"
    monkeypatch.setattr(algorithm_index, "INDEX", index)
    index.write_text(algorithm_index.render().replace("fedcma", "fedcma2", 1))
    assert algorithm_index.main(["--check"]) == 1
    assert capsys.readouterr().err.endswith("README.md is stale: run python scripts/algorithm_index.py\n")
    index.write_text(algorithm_index.render())
    assert algorithm_index.main(["--check"]) == 0
