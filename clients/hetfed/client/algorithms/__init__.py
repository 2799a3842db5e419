"""Client halves of the algorithms (torch), bound to their specs by import (``@SPEC.client_half``)."""

from __future__ import annotations

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.wire.specs import AlgorithmSpec, load_half

__all__ = ["ClientContext", "ClientHalf", "client_half_type", "make_client_half"]


def client_half_type(spec: AlgorithmSpec) -> type[ClientHalf]:  # type: ignore[type-arg]
    """The client half bound to ``spec`` (its ``make_model`` builds the model); hetfed's own client halves are
    imported on first use."""
    import hetfed.client.algorithms.registered  # noqa: F401 (binds each half to its spec)
    return load_half(spec, ClientHalf, "client")


def make_client_half(spec: AlgorithmSpec, ctx: ClientContext) -> ClientHalf:  # type: ignore[type-arg]
    """The client half bound to ``spec``, built on a context holding a config of ``spec.config_type``."""
    return client_half_type(spec)(ctx)
