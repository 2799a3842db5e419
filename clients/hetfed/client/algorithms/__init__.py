"""Client halves of the algorithms (torch), found through the spec (its ``client``, ``"module:Class"``)."""

from __future__ import annotations

import importlib

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.wire.specs import AlgorithmSpec

__all__ = ["ClientContext", "ClientHalf", "client_half_type", "make_client_half"]


def client_half_type(spec: AlgorithmSpec) -> type[ClientHalf]:  # type: ignore[type-arg]
    """The client half class ``spec`` names, imported on first use (its ``make_model`` builds the model)."""
    module, _, name = spec.client.partition(":")
    try:
        half = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"algorithm {spec.name!r}: its client half {spec.client!r} cannot be loaded: {exc}") from None
    if not (isinstance(half, type) and issubclass(half, ClientHalf)):
        raise ValueError(f"algorithm {spec.name!r}: {spec.client!r} is not a ClientHalf")
    return half


def make_client_half(spec: AlgorithmSpec, ctx: ClientContext) -> ClientHalf:  # type: ignore[type-arg]
    """The client half ``spec`` names, built on a context holding a config of ``spec.config_type``."""
    return client_half_type(spec)(ctx)
