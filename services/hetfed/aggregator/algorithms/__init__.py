"""Server halves of the algorithms (numpy only), registered by spec name."""

from __future__ import annotations

from collections.abc import Callable

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.algorithms.fedavg import HeadFedAvgServer, LocalServer, ModelFedAvgServer
from hetfed.aggregator.algorithms.fedcma import FedCMAServer
from hetfed.aggregator.algorithms.fedh2l import FedH2LServer
from hetfed.wire.specs import SPECS, TrainConfig

SERVER_HALVES: dict[str, Callable[[TrainConfig, int], ServerHalf]] = {
    "local": LocalServer,
    "fedavg": ModelFedAvgServer,
    "fedprox": ModelFedAvgServer,
    "fedavg_head": HeadFedAvgServer,
    "fedcma": FedCMAServer,
    "fedh2l": FedH2LServer,
}


def make_server_half(algorithm: str, config: TrainConfig, seed: int) -> ServerHalf:
    """The server half for a spec name, built with the run's typed config and seed."""
    if algorithm not in SPECS:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    if algorithm not in SERVER_HALVES:
        raise ValueError(f"algorithm {algorithm!r} has no server half")
    return SERVER_HALVES[algorithm](config, seed)
