"""fedrep's experiment side: its page (its training defaults are its config's, the paper's and its code's).

Its spec is :mod:`hetfed.wire.specs.fedrep`; every data set runs with the config's defaults, so a hand-written
aggregator file and ``hetfed run`` train it alike.
"""

from __future__ import annotations

from hetfed.cli.experiments.base import Experiment
from hetfed.wire.specs.fedrep import SPEC

__all__ = ["EXPERIMENT", "SPEC"]

EXPERIMENT = Experiment(docs="algorithms/fedrep.md")
