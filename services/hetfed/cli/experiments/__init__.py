"""The experiment side: local-run defaults, figure labels, documentation pages and reproduction grids.

``hetfed run`` and ``hetfed bench`` read these by the spec's (or the dataset's) name; the wire package,
the aggregator and the client runtime never import them. The ``<name>.bench.toml`` grids live beside
this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.algorithms import (
           DEFAULT_COMPARISON,
           EXPERIMENTS,
           bytes_reference,
           docs_page,
           experiment,
)
from hetfed.cli.experiments.base import ANY_DATASET, Experiment, FigureLabel, LocalDefaults
from hetfed.cli.experiments.datasets import DATASET_DEFAULTS, dataset_defaults

__all__ = ["ANY_DATASET", "DATASET_DEFAULTS", "DEFAULT_COMPARISON", "EXPERIMENTS", "Experiment", "FigureLabel",
           "LocalDefaults", "bytes_reference", "dataset_defaults", "docs_page", "experiment"]
