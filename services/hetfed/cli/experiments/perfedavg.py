"""perfedavg's experiment side: its `hetfed run` defaults, its figure's label and its page.

Its spec is :mod:`hetfed.wire.specs.perfedavg` (its config dataclass holds the training defaults of the
implementations that follow the paper: β = 0.001, α = 0.01, four steps a round).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.perfedavg import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # hetfed's own: a local run has tens of rounds, not the hundreds β = 0.001 needs. The β step takes the
        # baselines' SGD (lr 0.01, momentum 0.9) and, like them, two epochs a round (each step reads 2B
        # examples); α = 0.01 (docs/algorithms/perfedavg.md measures it).
        ANY_DATASET: LocalDefaults(config={"lr": 0.01, "momentum": 0.9, "alpha": 0.01, "local_steps": 0,
                                           "local_epochs": 2}),
    },
    labels={"global": FigureLabel(
        "global model", "the averaged model w before its α-step, on each organization's own test set")},
    docs="algorithms/perfedavg.md",
)
