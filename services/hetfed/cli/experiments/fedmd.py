"""fedmd's experiment side: its `hetfed run` defaults and its page.

Its spec is :mod:`hetfed.wire.specs.fedmd` (its config dataclass holds its training defaults, the reference
code's).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, LocalDefaults
from hetfed.wire.specs.fedmd import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # FedMD needs a public set every organization holds: the partition with a shared seed set, as FedH2L
        # runs it; 20 rounds (the reference code's N_rounds) and FedH2L's four architectures.
        ANY_DATASET: LocalDefaults(rounds=20, models=("lenet", "mlp", "fedgen_cnn", "lenet_wide"),
                                   partition="rotated"),
    },
    docs="algorithms/fedmd.md",
)
