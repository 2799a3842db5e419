"""fedgen's experiment side: its `hetfed run` defaults and its page.

Its spec is :mod:`hetfed.wire.specs.fedgen` (its config dataclass holds its training defaults, the reference
code's MNIST settings).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, LocalDefaults
from hetfed.wire.specs.fedgen import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # FedGen averages the encoder, so every organization runs one architecture: the reference code's MNIST
        # CNN, whose latent (the generator's output) has 32 values (utils/model_config.py:9, 20).
        ANY_DATASET: LocalDefaults(models=("fedgen_cnn",), latent_dim=32),
        "synthetic": LocalDefaults(models=("mlp",)),
        "gauss4": LocalDefaults(models=("mlp",), latent_dim=2),
    },
    docs="algorithms/fedgen.md",
)
