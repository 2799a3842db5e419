"""Every algorithm's experiment settings, by the spec's name (an algorithm without an entry gets none), gathered
from the module named after each algorithm.

A preset (``ditto_cos``, ``fedl2r``) shares the entry of the algorithm it presets unless it has its own.
"""

from __future__ import annotations

from hetfed.cli.experiments import (
    ditto,
    fedavg,
    fedavg_body,
    fedcma,
    fedfomo,
    fedgen,
    fedgen_head,
    fedh2l,
    fedmd,
    fedproto,
    fedrep,
    fedsr,
    fml,
    simfed,
)
from hetfed.cli.experiments.base import Experiment
from hetfed.wire.specs import AlgorithmSpec

# What ``hetfed run`` compares when the user names no algorithm: the federated baseline against local training.
DEFAULT_COMPARISON: tuple[str, ...] = ("fedavg", "local")

# Each algorithm's entry lives in the module named after it (``fedcma.py`` beside ``fedcma*.bench.toml``), which
# imports its spec; FedAvg comes first, as the reference that reports compare bytes with.
EXPERIMENTS: dict[str, Experiment] = {
    module.SPEC.name: module.EXPERIMENT for module in (fedavg, fedcma, fedh2l, fedsr, simfed, ditto, fedavg_body, fedrep,
                                                       fedproto, fedmd, fedfomo, fml, fedgen, fedgen_head)
}


def experiment(spec: AlgorithmSpec) -> Experiment:
    """The experiment settings of ``spec``: its own entry, else its family's (a preset's algorithm), else none."""
    found = EXPERIMENTS.get(spec.name) or EXPERIMENTS.get(spec.family)
    return found if found is not None else Experiment()


def docs_page(spec: AlgorithmSpec) -> str:
    """The algorithm's page under docs/ (a preset shares its algorithm's)."""
    return experiment(spec).docs or f"algorithms/{spec.family}.md"


def bytes_reference() -> tuple[str, str]:
    """(name, label) of the algorithm whose bytes per round reports compare every run's with; ("", "") if none."""
    for name, entry in EXPERIMENTS.items():
        if entry.bytes_reference:
            return name, entry.bytes_reference
    return "", ""
