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
        # network (z = 64). The reference code's generator (2048 noise, 4096 hidden: 8.7 M values) would be
        # twenty times the network on the wire each way; a CPU run takes a small one, and a bare output,
        # since this network's features are signed (the reference's AlexNet features end in a ReLU).
        "mnist5k": LocalDefaults(rounds=10, models=("rmnist_cnn",), latent_dim=64, partition="rotated_lodo",
                                 config={"noise_dim": 64, "generator_hidden": 256, "generator_relu": False,
                                         "projection_dim": 256, "discriminator_hidden": 256}),
    },
    labels={
        "target": FigureLabel("target acc", "accuracy on the held-out target domain (every organization holds "
                                            "the same global model)"),
        "source_val": FigureLabel("source val acc", "accuracy on the organizations' own validation splits"),
    },
    docs="algorithms/fedadg.md",
)
