"""Server halves of the algorithms (numpy only), found through the spec (its ``server``, ``"module:Class"``)."""

from __future__ import annotations

import importlib

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.specs import AlgorithmSpec, TrainConfig


def server_half_type(spec: AlgorithmSpec) -> type[ServerHalf]:  # type: ignore[type-arg]
    """The server half class ``spec`` names, imported on first use."""
    module, _, name = spec.server.partition(":")
    try:
        half = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"algorithm {spec.name!r}: its server half {spec.server!r} cannot be loaded: {exc}") from None
    if not (isinstance(half, type) and issubclass(half, ServerHalf)):
        raise ValueError(f"algorithm {spec.name!r}: {spec.server!r} is not a ServerHalf")
    return half


def make_server_half(spec: AlgorithmSpec, config: TrainConfig, run: RunInfo) -> ServerHalf:  # type: ignore[type-arg]
    """The server half ``spec`` names, built with the run's typed config (of ``spec.config_type``)."""
    return server_half_type(spec)(config, run)
