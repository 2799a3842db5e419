"""ditto's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.ditto` (its config dataclass holds its training defaults); its grids are
``ditto*.bench.toml`` beside this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment, FigureLabel, LocalDefaults
from hetfed.wire.specs.ditto import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    defaults={
        # Synthetic's own defaults are the paper's Appendix C setup (experiments/datasets.py); Ditto adds the
        # width of its Linear(60, 20) → Linear(20, 10) network.
        "synthetic": LocalDefaults(latent_dim=20),
    },
    labels={"global": FigureLabel(
        "global model", "the averaged global model w̄ on each organization's own test set (FedAvg's model)")},
    docs="algorithms/ditto.md",
)
