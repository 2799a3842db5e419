"""fedproto's experiment side: its `hetfed run` defaults, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.fedproto` (its config dataclass holds its training defaults, the paper's).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.fedproto import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # FedProto's point is heterogeneous models sharing one prototype space: organizations alternate a CNN and
        # an MLP; prototypes of 50 values, the paper's MNIST size (the reference CNN's fc1 with its ReLU).
        ANY_DATASET: LocalDefaults(models=("fedgen_cnn", "mlp"), latent_dim=50),
        "synthetic": LocalDefaults(models=("mlp",)),
        "gauss4": LocalDefaults(models=("mlp",), latent_dim=2),
    },
    labels={"prototype": FigureLabel(
        "nearest prototype", "each organization's encoder classifying by the nearest global prototype among its "
                             "own classes, on its own test set")},
    docs="algorithms/fedproto.md",
)
