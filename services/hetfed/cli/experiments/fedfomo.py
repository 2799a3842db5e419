"""fedfomo's experiment side: its `hetfed run` defaults and its page.

Its spec is :mod:`hetfed.wire.specs.fedfomo` (its config dataclass holds its training defaults, the reference
code's).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, LocalDefaults
from hetfed.wire.specs.fedfomo import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # 20 rounds: the README's --max_epoch 20 (each of 5 local epochs, the config's local_epochs). Every
        # organization runs the dataset's default architecture: peers' models must load into its own.
        ANY_DATASET: LocalDefaults(rounds=20),
    },
    docs="algorithms/fedfomo.md",
)
