"""FedProx (Li et al. 2020): FedAvg plus a proximal term in the local objective; the wire is FedAvg's."""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.fedavg import FedAvgConfig


@dataclass(frozen=True)
class FedProxConfig(FedAvgConfig):
    """FedProx: FedAvg plus the proximal term (mu/2)·||w - w_global||² in the local objective."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.mu >= 0, f"mu must be >= 0, got {self.mu}")


SPEC = fedavg.SPEC.derive(
    name="fedprox",
    summary="FedProx (Li et al. 2020): FedAvg with a proximal term in the local objective.",
    config_type=FedProxConfig,
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # the server half is FedAvg's: the weighted mean of the models
)
