"""Client halves of the algorithms (torch), registered by spec name (one line per algorithm)."""

from __future__ import annotations

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.ditto import DittoClient
from hetfed.client.algorithms.fedavg import FedAvgClient
from hetfed.client.algorithms.fedavg_body import FedAvgBodyClient
from hetfed.client.algorithms.fedavg_head import HeadFedAvgClient
from hetfed.client.algorithms.fedcma import FedCMAClient
from hetfed.client.algorithms.fedh2l import FedH2LClient
from hetfed.client.algorithms.fedprox import FedProxClient
from hetfed.client.algorithms.fedsr import FedSRClient
from hetfed.client.algorithms.local import LocalClient
from hetfed.client.algorithms.simfed import SimFedClient
from hetfed.wire.specs import AlgorithmSpec

CLIENT_HALVES: dict[str, type[ClientHalf]] = {  # type: ignore[type-arg]
    "local": LocalClient,
    "fedavg": FedAvgClient,
    "fedprox": FedProxClient,
    "fedavg_head": HeadFedAvgClient,
    "fedcma": FedCMAClient,
    "fedh2l": FedH2LClient,
    # FedL2R and FedCMI are FedSR configurations (their configs' defaults switch a term off)
    "fedsr": FedSRClient,
    "fedl2r": FedSRClient,
    "fedcmi": FedSRClient,
    "fedavg_body": FedAvgBodyClient,
    "simfed": SimFedClient,
    # One client half for Ditto and its named variants (they differ in their configs' defaults only).
    "ditto": DittoClient,
    "ditto_cos": DittoClient,
    "ditto_mkmmd": DittoClient,
    "ditto_mmdd": DittoClient,
}


def client_half_type(spec: AlgorithmSpec) -> type[ClientHalf]:  # type: ignore[type-arg]
    """The client half class registered for ``spec`` (its ``make_model`` builds the organization's model)."""
    try:
        return CLIENT_HALVES[spec.name]
    except KeyError:
        raise ValueError(f"algorithm {spec.name!r} has no client half; available: {sorted(CLIENT_HALVES)}") from None


def make_client_half(spec: AlgorithmSpec, ctx: ClientContext) -> ClientHalf:  # type: ignore[type-arg]
    """The client half registered for ``spec``, built on a context holding a config of ``spec.config_type``."""
    return client_half_type(spec)(ctx)
