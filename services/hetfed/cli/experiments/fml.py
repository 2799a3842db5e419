"""fml's experiment side: its `hetfed run` defaults, its figure's label and its page.

Its spec is :mod:`hetfed.wire.specs.fml` (its config dataclass holds its training defaults, the authors' code's).
"""

from __future__ import annotations

from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.fml import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

# Organizations bring different architectures (FML's model heterogeneity): FedH2L's and FedMD's four on images,
# the three that take any input elsewhere. The meme model is the config's (mlp: any input).
_ANY_INPUT = LocalDefaults(models=("mlp", "mlp1", "linear"))

EXPERIMENT = Experiment(
    defaults={
        ANY_DATASET: LocalDefaults(models=("lenet", "mlp", "fedgen_cnn", "lenet_wide")),
        "synthetic": _ANY_INPUT,
        "gauss4": _ANY_INPUT,
    },
    labels={"meme": FigureLabel(
        "meme model", "the averaged meme model w̄ on each organization's own test set (what FML's server holds)")},
    docs="algorithms/fml.md",
)
