"""Local training: no federation; organizations report metrics and share nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, TrainConfig


@dataclass(frozen=True)
class LocalConfig(TrainConfig):
    """Local training: no federation, metrics only. ``keep_optimizer_state`` (false) is the baseline at the
    optimiser of a method that keeps its own (Fed-CMA's authors' code builds it once, worker.py:132-137)."""


SPEC = AlgorithmSpec(
    name="local",
    summary="Local training only; organizations report metrics and share nothing else.",
    config_type=LocalConfig,
    upload=frozenset({K.EVAL_METRICS}),
    required_upload=frozenset({K.EVAL_METRICS}),
    download=frozenset(),
    model_private=True,
    shared_label_space=False,  # nothing is shared
    shared_input_shape=False,
    unsummed_because="it uploads nothing but metrics: there is nothing to sum",
)
