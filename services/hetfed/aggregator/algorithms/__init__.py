"""Server halves of the algorithms (numpy only), found through the spec (its ``server``, ``"module:Class"``)."""

from __future__ import annotations

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.specs import AlgorithmSpec, TrainConfig, load_half


def server_half_type(spec: AlgorithmSpec) -> type[ServerHalf]:  # type: ignore[type-arg]
    """The server half class ``spec`` names, imported on first use."""
    return load_half(spec, spec.server, ServerHalf, "server")


def make_server_half(spec: AlgorithmSpec, config: TrainConfig, run: RunInfo) -> ServerHalf:  # type: ignore[type-arg]
    """The server half ``spec`` names, built with the run's typed config (of ``spec.config_type``)."""
    return server_half_type(spec)(config, run)
