"""The organization's own record of its exact figures, which its uploads withhold under ``[privacy]``.

Under ``[privacy]`` a client with an ``output_dir`` keeps ``<output_dir>/own-figures.json``: each report's exact
figures by round (its true training count, not the released one), rewritten atomically after each round. Nothing
here is sent. A local run owns every organization, so it reads these files on its own machine (``hetfed run``'s
``own_final_test_accuracy``). Without ``[privacy]`` nothing is written: the uploads carry the exact figures.

No torch here: the local run reads these records without loading it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetfed.wire.payloads import EvalMetrics

OWN_FIGURES = "own-figures.json"
"""The own record's file name under a client's ``output_dir``."""


def own_entry(round_: int, metrics: EvalMetrics, num_train_examples: int) -> dict[str, Any]:
    """One report's exact figures (``num_train_examples``: the true count, which the report may carry released)."""
    return {"round": round_, "train_loss": float(metrics.train_loss), "test_accuracy": float(metrics.test_accuracy),
            "test_loss": float(metrics.test_loss), "num_test_examples": int(metrics.num_test_examples),
            "num_train_examples": int(num_train_examples), "extra": {k: float(v) for k, v in metrics.extra.items()}}


class OwnRecord:
    """``<output_dir>/own-figures.json`` of one organization in one run."""

    def __init__(self, output_dir: str | Path, organization: str, run: str, resumed_round: int = -1) -> None:
        """A new record; ``resumed_round`` >= 0: the client resumed after that round, so the rounds up to it are
        kept from the file an earlier process of the same run wrote. A fresh start replaces any earlier file."""
        self.path = Path(output_dir) / OWN_FIGURES
        self.organization, self.run = organization, run
        self.entries: list[dict[str, Any]] = []
        if resumed_round >= 0:
            old = read_own_record(self.path)
            if old is not None and (old.get("organization"), old.get("run")) == (organization, run):
                self.entries = [e for e in old.get("rounds", []) if e["round"] <= resumed_round]
        self.write()

    def record(self, round_: int, reports: list[EvalMetrics], num_train_examples: int) -> None:
        """Set round ``round_``'s reports (a round done again replaces them) and rewrite the file."""
        kept = [e for e in self.entries if e["round"] != round_]
        self.entries = sorted(kept + [own_entry(round_, m, num_train_examples) for m in reports],
                              key=lambda e: e["round"])
        self.write()

    def write(self) -> None:
        """Write the file atomically: a reader sees the previous record or this one, never a part."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{OWN_FIGURES}.tmp")
        tmp.write_text(json.dumps({"organization": self.organization, "run": self.run, "rounds": self.entries},
                                  indent=1))
        os.replace(tmp, self.path)


def read_own_record(path: str | Path) -> dict[str, Any] | None:
    """The record at ``path``; None when there is none."""
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return data


def entry_at(record: Mapping[str, Any], round_: int) -> dict[str, Any] | None:
    """The record's last report of round ``round_``; None when it has none."""
    found = [e for e in record.get("rounds", []) if e["round"] == round_]
    return found[-1] if found else None
