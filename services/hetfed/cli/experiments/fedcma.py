"""fedcma's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.fedcma` (its config dataclass holds its training defaults); its grids are
``fedcma*.bench.toml`` beside this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.fedcma import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # The point of Fed-CMA is heterogeneous encoders: organizations alternate a CNN and an MLP.
        ANY_DATASET: LocalDefaults(models=("fedgen_cnn", "mlp"), latent_dim=32),
        "synthetic": LocalDefaults(models=("mlp",)),
        # The 2-D toy: a 2-D latent space to draw, and enough local steps for the alignment to act.
        "gauss4": LocalDefaults(models=("mlp",), latent_dim=2, rounds=30, config={"lr": 0.1, "local_steps": 10}),
    },
    labels={"global_head": FigureLabel(
        "encoder + v̄", "each organization's private encoder with the global head v̄, on its own test set")},
    docs="algorithms/fedcma.md",
)
