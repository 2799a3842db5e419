"""fedavg_body's experiment side (and its preset fedper's): its page; its training defaults are FedAvg's.

Its spec is :mod:`hetfed.wire.specs.fedavg_body`.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment
from hetfed.wire.specs.fedavg_body import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(docs="algorithms/fedavg_body.md")
