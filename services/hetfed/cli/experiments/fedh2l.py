"""fedh2l's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.fedh2l` (its config dataclass holds its training defaults); its grids are
``fedh2l*.bench.toml`` beside this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.fedh2l import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # One round is one iteration of Algorithm 1 (one local and one mutual-learning step), so many rounds;
        # four different architectures, as the paper mixes networks. The optimiser is its config's (AMSGrad).
        ANY_DATASET: LocalDefaults(rounds=500, models=("lenet", "mlp", "fedgen_cnn", "lenet_wide"),
                                   partition="rotated"),
    },
    labels={
        "wdp": FigureLabel("WDP", "within-domain performance: accuracy on the own domain's test set"),
        "cdp": FigureLabel("CDP", "cross-domain performance: the other domains' test sets"),
        "acc": FigureLabel("ACC", "accuracy on every domain's test set"),
    },
    docs="algorithms/fedh2l.md",
)
