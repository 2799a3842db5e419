"""FedAvg (McMahan et al. 2017): the server averages whole models weighted by example counts."""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, TrainConfig


@dataclass(frozen=True)
class FedAvgConfig(TrainConfig):
    """FedAvg: the server averages whole models weighted by example counts."""


SPEC = AlgorithmSpec(
    name="fedavg",
    summary="FedAvg (McMahan et al. 2017): weighted average of whole models.",
    config_type=FedAvgConfig,
    upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    download=frozenset({K.MODEL_WEIGHTS}),
    shared_schema=frozenset({K.MODEL_WEIGHTS}),
)
