"""Client halves of the algorithms (torch), registered by spec name."""

from __future__ import annotations

from collections.abc import Callable

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.fedavg import FedAvgClient, HeadFedAvgClient, LocalClient
from hetfed.client.algorithms.fedcma import FedCMAClient
from hetfed.client.algorithms.fedh2l import FedH2LClient

CLIENT_HALVES: dict[str, Callable[[ClientContext], ClientHalf]] = {
    "local": LocalClient,
    "fedavg": FedAvgClient,
    "fedprox": FedAvgClient,
    "fedavg_head": HeadFedAvgClient,
    "fedcma": FedCMAClient,
    "fedh2l": FedH2LClient,
}


def make_client_half(algorithm: str, ctx: ClientContext) -> ClientHalf:
    """The client half for a spec name."""
    if algorithm not in CLIENT_HALVES:
        raise ValueError(f"algorithm {algorithm!r} has no client half; available: {sorted(CLIENT_HALVES)}")
    return CLIENT_HALVES[algorithm](ctx)
