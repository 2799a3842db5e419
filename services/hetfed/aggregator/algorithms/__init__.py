"""Server halves of the algorithms (numpy only), bound to their specs by import (``@SPEC.server_half``)."""

from __future__ import annotations

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.specs import AlgorithmSpec, TrainConfig, load_half


def server_half_type(spec: AlgorithmSpec) -> type[ServerHalf]:  # type: ignore[type-arg]
    """The server half bound to ``spec``; hetfed's own server halves are imported on first use."""
    import hetfed.aggregator.algorithms.registered  # noqa: F401 (binds each half to its spec)
    return load_half(spec, ServerHalf, "server")


def make_server_half(spec: AlgorithmSpec, config: TrainConfig, run: RunInfo) -> ServerHalf:  # type: ignore[type-arg]
    """The server half bound to ``spec``, built with the run's typed config (of ``spec.config_type``)."""
    return server_half_type(spec)(config, run)
