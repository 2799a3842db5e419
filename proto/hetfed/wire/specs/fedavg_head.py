"""Head-only FedAvg (LG-FedAvg / FedAvgSim): only the classifier head is averaged; encoders stay private."""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec
from hetfed.wire.specs.fedavg import AveragingConfig


@dataclass(frozen=True)
class HeadFedAvgConfig(AveragingConfig):
    """Head-only FedAvg: only the classification head is averaged; encoders stay private."""


SPEC = AlgorithmSpec(
    name="fedavg_head",
    summary="Head-only FedAvg (LG-FedAvg style): only the classifier head is averaged.",
    config_type=HeadFedAvgConfig,
    upload=frozenset({K.HEAD_WEIGHTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.HEAD_WEIGHTS, K.EVAL_METRICS}),
    summed_upload=frozenset({K.HEAD_WEIGHTS}),
    download=frozenset({K.HEAD_WEIGHTS}),
    shared_schema=frozenset({K.HEAD_WEIGHTS}),
    model_private=True,
)
