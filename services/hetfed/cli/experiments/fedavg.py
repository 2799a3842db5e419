"""fedavg's experiment side: its `hetfed run` defaults per data set, its figures' labels and its page.

Its spec is :mod:`hetfed.wire.specs.fedavg` (its config dataclass holds its training defaults); its grids are
``fedavg*.bench.toml`` beside this module.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment
from hetfed.wire.specs.fedavg import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

# Every organization sends and receives the whole model: what reports compare other algorithms' bytes with.
EXPERIMENT = Experiment(bytes_reference="FedAvg")
