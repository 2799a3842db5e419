"""fedadg's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.fedadg` (its config dataclass holds its training defaults, the authors' code's).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.fedadg import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # Rotated MNIST leave one domain out, where FedSR's paper compares with FedADG (Table 1), on FedSR's
        # network (z = 64); 10 rounds, a CPU budget.
        "mnist5k": LocalDefaults(rounds=10, models=("rmnist_cnn",), latent_dim=64, partition="rotated_lodo"),
    },
    labels={
        "target": FigureLabel("target acc", "accuracy on the held-out target domain (every organization holds "
                                            "the same global model)"),
        "source_val": FigureLabel("source val acc", "accuracy on the organizations' own validation splits"),
    },
    docs="algorithms/fedadg.md",
)
