"""FedRep (Collins et al., ICML 2021): a shared body averaged by the server, a personal head never sent.

Each round an organization trains its head with the body frozen, then its body with the head frozen, and sends
the body. The wire is FedAvg of the body's: model weights without the head, up and down. The defaults are the
paper's and its authors' code's (lgcollins/FedRep); docs/algorithms/fedrep.md labels each with its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg_body
from hetfed.wire.specs.fedavg import FedAvgConfig


@dataclass(frozen=True)
class FedRepConfig(FedAvgConfig):
    """FedRep: ``local_epochs`` per round, the first ``local_epochs - body_epochs`` on the head alone (body
    frozen), the last ``body_epochs`` on the body alone (head frozen); one SGD rate for both."""

    # τ_h + τ_b: the reference code's --local_ep 11 with --local_rep_ep 1 (scripts/FedRep_cifar10_*.sh).
    local_epochs: int = 11
    # τ_b, the body's epochs (--local_rep_ep, utils/options.py:39); the head gets the rest, τ_h = 10.
    body_epochs: int = 1
    batch_size: int = 10  # --local_bs 10 in every FedRep script
    momentum: float = 0.5  # models/Update.py:564 (LocalUpdate's SGD)
    weight_decay: float = 1e-4  # models/Update.py:561 (on weights; the code spares biases)
    # Algorithm 1 averages the representations uniformly, 1/(rn) Σ φ_i.
    weighting: Literal["examples", "uniform"] = "uniform"

    @property
    def head_epochs(self) -> int:
        """τ_h: the head's epochs each round."""
        return self.local_epochs - self.body_epochs

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.local_steps == 0,
              f"fedrep counts its two phases in epochs (local_epochs, body_epochs); local_steps must be 0, "
              f"got {self.local_steps}")
        check(1 <= self.body_epochs < self.local_epochs,
              f"body_epochs must be >= 1 and leave the head at least one of the local_epochs "
              f"({self.local_epochs}), got {self.body_epochs}")


SPEC = fedavg_body.SPEC.derive(
    name="fedrep",
    summary="FedRep (Collins et al. 2021): each round the head trains with the body frozen, then the body with "
            "the head frozen; only the body is averaged, the head is never sent.",
    config_type=FedRepConfig,
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # FedAvg's weighted mean of the bodies; heads never leave
)
