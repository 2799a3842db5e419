"""cfl's experiment side: its `hetfed run` defaults and its page.

Its spec is :mod:`hetfed.wire.specs.cfl` (its config dataclass holds its training and splitting defaults, the
paper's and the reference code's).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, LocalDefaults
from hetfed.wire.specs.cfl import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # 80 rounds: the reference notebook's COMMUNICATION_ROUNDS, so that its first possible split (after round
        # 20) has time to pay off. Models and partition are the dataset's.
        ANY_DATASET: LocalDefaults(rounds=80),
    },
    docs="algorithms/cfl.md",
)
