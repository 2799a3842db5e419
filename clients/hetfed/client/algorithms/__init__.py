"""Client halves of the algorithms (torch), found through the spec (its ``client``, ``"module:Class"``)."""

from __future__ import annotations

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.wire.specs import AlgorithmSpec, load_half

__all__ = ["ClientContext", "ClientHalf", "client_half_type", "make_client_half"]


def client_half_type(spec: AlgorithmSpec) -> type[ClientHalf]:  # type: ignore[type-arg]
    """The client half class ``spec`` names, imported on first use (its ``make_model`` builds the model)."""
    return load_half(spec, spec.client, ClientHalf, "client")


def make_client_half(spec: AlgorithmSpec, ctx: ClientContext) -> ClientHalf:  # type: ignore[type-arg]
    """The client half ``spec`` names, built on a context holding a config of ``spec.config_type``."""
    return client_half_type(spec)(ctx)
