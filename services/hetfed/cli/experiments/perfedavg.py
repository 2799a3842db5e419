"""perfedavg's experiment side: its figure's label and its page.

Its spec is :mod:`hetfed.wire.specs.perfedavg`; every data set runs with its config's defaults, so a hand-written
aggregator file and ``hetfed run`` train it alike.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment, FigureLabel
from hetfed.wire.specs.perfedavg import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(
    labels={"global": FigureLabel(
        "global model", "the averaged model w before its α-step, on each organization's own test set")},
    docs="algorithms/perfedavg.md",
)
