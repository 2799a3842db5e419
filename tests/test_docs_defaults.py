"""docs/configuration.md's table of training defaults is the registry's: each row, field by field."""

from __future__ import annotations

import re
from pathlib import Path

from hetfed.wire.specs import SPECS

TABLE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEAD = "| algorithm | local work | batch | optimizer | lr | momentum | weight decay | source |"


def documented() -> dict[str, tuple[str, ...]]:
    """Algorithm name -> its row's cells (local work to weight decay), for every name a row lists."""
    lines = TABLE.read_text().splitlines()
    start = lines.index(HEAD) + 2
    rows: dict[str, tuple[str, ...]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([a-z0-9_]+)`", cells[0]):
            rows[name] = tuple(cells[1:7])
    return rows


def declared(name: str) -> tuple[str, ...]:
    c = SPECS[name].config()
    work = f"{c.local_steps} steps" if c.local_steps else f"{c.local_epochs} epochs"
    return (work, str(c.batch_size), c.optimizer, f"{c.lr:g}", f"{c.momentum:g}", f"{c.weight_decay:g}")


def test_every_algorithm_has_one_row_that_states_its_declared_defaults() -> None:
    rows = documented()
    assert sorted(rows) == sorted(SPECS)
    assert {name: row for name, row in rows.items() if row != declared(name)} == {}
