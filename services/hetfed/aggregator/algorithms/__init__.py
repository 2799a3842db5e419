"""Server halves of the algorithms (numpy only), registered by spec name (one line per algorithm)."""

from __future__ import annotations

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.aggregator.algorithms.fedavg_head import HeadFedAvgServer
from hetfed.aggregator.algorithms.fedcma import FedCMAServer
from hetfed.aggregator.algorithms.fedh2l import FedH2LServer
from hetfed.aggregator.algorithms.local import LocalServer
from hetfed.aggregator.algorithms.simfed import SimFedServer
from hetfed.wire.specs import AlgorithmSpec, TrainConfig

SERVER_HALVES: dict[str, type[ServerHalf]] = {  # type: ignore[type-arg]
    "local": LocalServer,
    "fedavg": FedAvgServer,
    "fedprox": FedAvgServer,  # FedProx differs from FedAvg only in the client objective
    "fedavg_head": HeadFedAvgServer,
    "fedcma": FedCMAServer,
    "fedh2l": FedH2LServer,
    # FedSR and its one-term variants: FedAvg of the whole model (uniform weights by their config's default)
    "fedsr": FedAvgServer,
    "fedl2r": FedAvgServer,
    "fedcmi": FedAvgServer,
    "fedavg_body": FedAvgServer,  # FedAvg of the body: the clients send only their encoders
    "simfed": SimFedServer,
    # Ditto and its variants: the global model is averaged exactly as FedAvg's; the personal model never leaves.
    "ditto": FedAvgServer,
    "ditto_cos": FedAvgServer,
    "ditto_mkmmd": FedAvgServer,
    "ditto_mmdd": FedAvgServer,
}


def make_server_half(spec: AlgorithmSpec, config: TrainConfig, run: RunInfo) -> ServerHalf:  # type: ignore[type-arg]
    """The server half registered for ``spec``, built with the run's typed config (of ``spec.config_type``)."""
    try:
        half = SERVER_HALVES[spec.name]
    except KeyError:
        raise ValueError(f"algorithm {spec.name!r} has no server half") from None
    return half(config, run)
