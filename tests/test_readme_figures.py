"""The README's measured figures are the ones a fresh measurement gives (scripts/readme_figures.py writes them).

A change that moves the default run's table or the suite's size fails here until
`python scripts/readme_figures.py` (or `--count`, for the size alone) is run again.
"""

from __future__ import annotations

import re
from types import ModuleType

import pytest

from tests.conftest import REPO, load_script

README = REPO / "README.md"


def figures() -> ModuleType:
    """scripts/readme_figures.py, imported once."""
    return load_script("readme_figures")


SAMPLE = "\n".join([
    "hetfed run: fedavg, local with 4 organizations on mnist5k (dirichlet, alpha=0.5), rounds: fedavg 10, local 10",
    "local          10/10 rounds  finished  acc  94.7%",
    "algorithm   own-test acc   global-test acc   bytes up   bytes down   bytes/round   time   ε   figures",
    "─" * 101,
    "fedavg      94.70%         94.70%            17.27 MB   17.27 MB     3.28 MB       24s    —   -      ",
    "local       94.70%         73.25%            10.39 KB   4.31 KB      1.35 KB       31s    —   -      ",
    ""])


def test_the_table_is_read_from_the_runs_output_without_the_time_column() -> None:
    """The last table of the output, right-stripped; its rows by column; only the time column left out."""
    f = figures()
    table = f.run_table(SAMPLE)
    assert table.splitlines()[0].startswith("algorithm ") and table.splitlines()[-1].endswith("—   -")
    assert f.fixed_columns(table) == [
        {"algorithm": "fedavg", "own-test acc": "94.70%", "global-test acc": "94.70%", "bytes up": "17.27 MB",
         "bytes down": "17.27 MB", "bytes/round": "3.28 MB", "ε": "—", "figures": "-"},
        {"algorithm": "local", "own-test acc": "94.70%", "global-test acc": "73.25%", "bytes up": "10.39 KB",
         "bytes down": "4.31 KB", "bytes/round": "1.35 KB", "ε": "—", "figures": "-"}]
    assert f.table_rows(table)[1]["time"] == "31s"


def test_a_block_is_replaced_between_its_markers_and_nowhere_else() -> None:
    """Only what lies between a block's markers changes; a missing block is named."""
    f = figures()
    begin, end = f.markers("test-count")
    text = f"The suite has {begin}12{end} tests."
    assert f.replace_block(text, "test-count", "1,751") == f"The suite has {begin}1,751{end} tests."
    assert f.readme_count(f.replace_block(text, "test-count", "1,751")) == 1751
    with pytest.raises(ValueError, match=re.escape("no <!-- readme_figures.py default-run: begin -->")):
        f.block(text, "default-run")


def test_the_readme_states_one_timing_with_its_date_and_commit() -> None:
    """The generated block holds the table, then one sentence: date, commit, seconds and cores."""
    f = figures()
    body = f.block(README.read_text(), "default-run")
    assert f.fixed_columns(f.run_table(body.split("```")[1]))  # a table with rows
    assert len(re.findall(r"\b\d+\.\d\s+s\s+on\s+\d+\s+CPU\s+cores", body)) == 1
    assert re.search(r"on\s+\d{4}-\d\d-\d\d\s+at\s+[0-9a-f]{7,}", body)
    # No other timing of `hetfed run` is left in the README outside the block.
    outside = README.read_text().replace(body, "")
    assert not re.search(r"`hetfed run`[^.]*\b\d+(\.\d)? s\b", outside)


@pytest.mark.e2e
def test_the_readmes_table_is_a_fresh_default_runs() -> None:
    """`hetfed run` with its defaults, once: every column but the time equals the README's table.

    The default run is seeded; a difference is a change of defaults or of behaviour (rerun the script), or a
    run that does not repeat (a bug).
    """
    f = figures()
    readme_table = f.run_table(f.block(README.read_text(), "default-run").split("```")[1])
    fresh, _ = f.default_run()
    assert f.fixed_columns(fresh) == f.fixed_columns(readme_table), fresh


def test_the_readmes_test_count_is_what_collection_finds() -> None:
    """`pytest --collect-only -q` of the default suite (slow tests deselected) counts the README's number."""
    f = figures()
    assert f.collected_count() == f.readme_count(README.read_text())
