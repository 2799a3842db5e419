"""fedsr's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.fedsr` (its config dataclass holds its training defaults); its grids are
``fedsr*.bench.toml`` beside this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.fedsr import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # Rotated MNIST leave one domain out with the paper's network (z = 64) and 100 rounds of E = 5 steps.
        "mnist5k": LocalDefaults(rounds=100, models=("rmnist_cnn",), latent_dim=64, partition="rotated_lodo"),
    },
    labels={
        "target": FigureLabel("target acc", "accuracy on the held-out target domain (every organization holds "
                                            "the same global model)"),
        "source_val": FigureLabel("source val acc", "accuracy on the organizations' own validation splits "
                                                    "(what settings are chosen on)"),
    },
    docs="algorithms/fedsr.md",
)
