"""simfed's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.simfed` (its config dataclass holds its training defaults); its grids are
``simfed*.bench.toml`` beside this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.simfed import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # 20 rounds of its config's 5 local epochs train MNIST-5k's small organizations about as far as the
        # tuning runs needed (docs/algorithms/simfed.md).
        ANY_DATASET: LocalDefaults(models=("lenet",), rounds=20),
        # The feature vectors take the MLP (LeNet needs images); gauss4's 2-D latent space is drawn.
        "synthetic": LocalDefaults(models=("mlp",)),
        "gauss4": LocalDefaults(models=("mlp",), latent_dim=2),
    },
    labels={
        "mask_density": FigureLabel("sent mask density",
                                    "share of the mask entries an organization sent in its last upload"),
        "trained_mask_density": FigureLabel(
            "trained mask density", "share of the non-zero entries of the mask an organization trained (sent "
                                    "or not)"),
    },
    docs="algorithms/simfed.md",
)
