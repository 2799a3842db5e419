"""FedAvg (McMahan et al. 2017): the server averages whole models weighted by example counts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, PeriodicEvalConfig, TrainConfig

Aggregation = Literal["mean", "trimmed_mean", "median"]
NormPolicy = Literal["refuse", "clip"]


@dataclass(frozen=True)
class AveragingConfig(TrainConfig):
    """How a server that averages the organizations' arrays (the FedAvg family) combines them."""

    # "mean": the mean weighted by example counts (FedAvg). "trimmed_mean": per coordinate, the unweighted mean
    # of the values left once the `trim` largest and `trim` smallest are dropped (robust to up to `trim`
    # arbitrary updates; docs/reliability.md says what it does and does not protect against).
    # "median": per coordinate, the unweighted median (keeps every update of the round in memory).
    aggregation: Aggregation = "mean"
    trim: int = 1
    # Each update's distance from the current global model, ||w_i - g||_2, at most this times ||g||_2 (0: no
    # bound; none before the first global model). "refuse": an update beyond it is refused (implausible_update);
    # "clip": it is scaled back onto the bound, g + (w_i - g) * bound / ||w_i - g|| (norm clipping).
    max_update_norm_ratio: float = 10.0
    update_norm_policy: NormPolicy = "refuse"
    # The largest magnitude of any floating-point value in an update (0: no bound); binds from the first round.
    max_abs_weight: float = 1e6

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.trim >= 1, f"trim must be >= 1, got {self.trim}")
        check(math.isfinite(self.max_update_norm_ratio) and self.max_update_norm_ratio >= 0,
              f"max_update_norm_ratio must be a finite number >= 0, got {self.max_update_norm_ratio}")
        check(math.isfinite(self.max_abs_weight) and self.max_abs_weight >= 0,
              f"max_abs_weight must be a finite number >= 0, got {self.max_abs_weight}")


@dataclass(frozen=True)
class FedAvgConfig(AveragingConfig, PeriodicEvalConfig):
    """FedAvg: the server averages whole models weighted by example counts (or uniformly)."""

    # "examples": weight each organization's model by its number of training examples (McMahan et al.);
    # "uniform": every organization counts the same (the leave-one-domain-out papers' FedAvg over source domains).
    # The trimmed mean is unweighted whatever this says.
    weighting: Literal["examples", "uniform"] = "examples"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.weighting in ("examples", "uniform"),
              f"weighting must be 'examples' or 'uniform', got {self.weighting!r}")


SPEC = AlgorithmSpec(
    name="fedavg",
    summary="FedAvg (McMahan et al. 2017): weighted average of whole models.",
    config_type=FedAvgConfig,
    upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    summed_upload=frozenset({K.MODEL_WEIGHTS}),
    download=frozenset({K.MODEL_WEIGHTS}),
    shared_schema=frozenset({K.MODEL_WEIGHTS}),
)
