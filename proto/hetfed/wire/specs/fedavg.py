"""FedAvg (McMahan et al. 2017): the server averages whole models weighted by example counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, TrainConfig

Aggregation = Literal["mean", "trimmed_mean"]


@dataclass(frozen=True)
class AveragingConfig(TrainConfig):
    """How a server that averages the organizations' arrays (the FedAvg family) combines them."""

    # "mean": the mean weighted by example counts (FedAvg). "trimmed_mean": per coordinate, the unweighted mean
    # of the values left once the `trim` largest and `trim` smallest are dropped (robust to up to `trim`
    # arbitrary updates; docs/reliability.md says what it does and does not protect against).
    aggregation: Aggregation = "mean"
    trim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.trim >= 1, f"trim must be >= 1, got {self.trim}")


@dataclass(frozen=True)
class FedAvgConfig(AveragingConfig):
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
