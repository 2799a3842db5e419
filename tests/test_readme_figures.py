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


def test_the_table_is_read_from_the_runs_output_without_the_machines_columns() -> None:
    """The last table of the output, right-stripped; its rows by column; the time and accuracies left out of
    the exact comparison."""
    f = figures()
    table = f.run_table(SAMPLE)
    assert table.splitlines()[0].startswith("algorithm ") and table.splitlines()[-1].endswith("—   -")
    assert f.fixed_columns(table) == [
        {"algorithm": "fedavg", "bytes up": "17.27 MB", "bytes down": "17.27 MB", "bytes/round": "3.28 MB",
         "ε": "—", "figures": "-"},
        {"algorithm": "local", "bytes up": "10.39 KB", "bytes down": "4.31 KB", "bytes/round": "1.35 KB",
         "ε": "—", "figures": "-"}]
    assert f.table_rows(table)[1]["global-test acc"] == "73.25%"
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
    """`hetfed run` with its defaults, once: every column but the time and the accuracies equals the README's
    table, and the accuracies are within ACCURACY_TOLERANCE_POINTS of it (another processor's arithmetic).

    The default run is seeded; a difference is a change of defaults or of behaviour (rerun the script). That a
    run repeats exactly on one machine is tests/e2e/test_repeatable.py's.
    """
    f = figures()
    readme_table = f.run_table(f.block(README.read_text(), "default-run").split("```")[1])
    fresh, _ = f.default_run()
    assert f.fixed_columns(fresh) == f.fixed_columns(readme_table), fresh
    assert not f.accuracy_differences(fresh, readme_table), (f.accuracy_differences(fresh, readme_table), fresh)


def test_accuracies_are_compared_within_the_tolerance_only() -> None:
    """An accuracy 0.3 points off passes, 2.5 points off fails, and a row missing on either side is named."""
    f = figures()
    head = "algorithm   own-test acc   global-test acc   bytes up\n" + "─" * 40 + "\n"
    readme = head + "fedavg      94.70%         94.70%            17.27 MB\nlocal       94.70%         73.25%            10.39 KB"
    near = head + "fedavg      95.00%         95.00%            17.27 MB\nlocal       94.00%         72.20%            10.39 KB"
    far = head + "fedavg      92.20%         94.70%            17.27 MB"
    assert f.accuracy_differences(near, readme) == []
    assert f.accuracy_differences(far, readme) == ["local: only in the README",
                                                   "fedavg own-test acc: README 94.70%, fresh run 92.20%"]


def test_the_readmes_test_count_is_what_collection_finds() -> None:
    """`pytest --collect-only -q` of the default suite (slow tests deselected) counts the README's number."""
    f = figures()
    assert f.collected_count() == f.readme_count(README.read_text())
