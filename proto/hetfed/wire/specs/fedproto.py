"""FedProto (Tan et al., AAAI 2022, "FedProto: Federated Prototype Learning across Heterogeneous Clients"): the
spec and its config.

Each organization keeps its own model (encoder and head, any architecture with the run's latent width) and sends
one prototype per class it holds: the mean embedding of its training examples of that class, with the count.
The server averages each class's prototypes over the organizations that hold it and sends the global prototypes
back; local training adds λ times the distance between each embedding and its class's global prototype to the
cross-entropy. Only K × d_e prototypes with their counts cross the wire, never a weight.

Defaults: the paper's and its authors' code's (github:yuetan031/FedProto), labelled in docs/algorithms/fedproto.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, Figure, SharedSpaceConfig


@dataclass(frozen=True)
class FedProtoConfig(SharedSpaceConfig):
    """FedProto: the weight λ of the prototype term, its distance, and how the server weighs prototypes.

    The training defaults are the paper's (appendix A: SGD at lr 0.01 with momentum 0.5, one local epoch of
    batch 8, a fresh optimiser every round as the reference code builds one per round).
    """

    # λ: weight of the prototype term (the reference code's --ld, default 1; the paper's best 1 on MNIST and
    # FEMNIST, 0.1 on CIFAR10).
    proto_weight: float = 1.0
    # "mse": the reference code's λ·MSELoss(C̄_y, z), the mean over the batch and the d_e dimensions of
    # (z − C̄_y)², an example whose class has no global prototype counting 0; "squared_l2": the paper's
    # convergence analysis, λ·‖z − C̄_y‖² averaged over the batch (d_e times the first).
    proto_distance: Literal["mse", "squared_l2"] = "mse"
    # How the server averages class j's prototypes over the set N_j of organizations that hold it:
    # "uniform": the reference code's mean over N_j; "count": weighted by |D_i,j| / N_j (the paper's q weights,
    # summing to 1); "paper": the paper's aggregation equation as printed, (1/|N_j|)·Σ (|D_i,j|/N_j)·C_i^(j).
    prototype_weighting: Literal["uniform", "count", "paper"] = "uniform"
    momentum: float = 0.5
    local_epochs: int = 1
    batch_size: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.proto_weight >= 0, f"proto_weight must be >= 0, got {self.proto_weight}")
        check(self.proto_distance in ("mse", "squared_l2"),
              f"proto_distance must be 'mse' or 'squared_l2', got {self.proto_distance!r}")
        check(self.prototype_weighting in ("uniform", "count", "paper"),
              f"prototype_weighting must be 'uniform', 'count' or 'paper', got {self.prototype_weighting!r}")


SPEC = AlgorithmSpec(
    name="fedproto",
    summary="FedProto (Tan et al. 2022): private heterogeneous models regularised toward global class prototypes; "
    "only K×d_e class prototypes with their counts cross the wire.",
    config_type=FedProtoConfig,
    upload=frozenset({K.CLASS_MEAN_EMBEDDINGS, K.EVAL_METRICS}),
    required_upload=frozenset({K.CLASS_MEAN_EMBEDDINGS, K.EVAL_METRICS}),
    download=frozenset({K.CLASS_MEAN_EMBEDDINGS}),
    model_private=True,
    figures=(Figure("prototype", "prototype_test_accuracy"),),
    unsummed_because=("its server keeps each class's example total and (under the uniform and paper weightings) "
                      "the number of organizations holding it: two weights per class where a secure sum carries one"),
)
