"""Clustered Federated Learning (Sattler, Müller and Samek, IEEE TNNLS 2020, "Clustered Federated Learning:
Model-Agnostic Distributed Multitask Optimization Under Privacy Constraints"): the spec and its config.

Every organization starts from one model θ_0, which it sends once in a setup phase (the numpy aggregator cannot
build a torch model). The server keeps clusters of organizations, one model per cluster, starting with one
cluster of everyone. Each round an organization receives its cluster's model, trains it and sends the weight
update Δθ_i (trained minus received). Within each cluster the server adds the example-weighted mean update to the
cluster's model. When a cluster's mean update is small (‖Δθ_c‖ < ε1: FedAvg of the cluster is near a
stationary point) while some member's is large (max ‖Δθ_i‖ > ε2), the server splits it in two by the cosine
similarities of its members' updates, the bipartition that minimises the largest similarity across the parts.

Defaults: the paper's and its authors' code's (github:felisat/clustered-federated-learning), labelled in
docs/algorithms/cfl.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, PeriodicEvalConfig

Linkage = Literal["single", "complete"]


@dataclass(frozen=True)
class CFLConfig(PeriodicEvalConfig):
    """CFL: the split criterion (ε1, ε2, γ_max), when a split may happen, how a cluster is bipartitioned and how
    its updates are weighted.

    The training defaults are the reference code's (its notebook: SGD at lr 0.1 with momentum 0.9, one epoch of
    batch 128 per round, the optimiser built once and its rate multiplied by 0.99 before every round).
    """

    # ε1: a cluster may split only while the norm of its weighted mean update is below it (the notebook's EPS_1).
    eps1: float = 0.4
    # ε2: ... and the largest norm of its members' updates is above it (the notebook's EPS_2).
    eps2: float = 1.6
    # γ_max of the paper's CFL algorithm: a bipartition is kept only when γ_max < sqrt((1 − α_cross_max) / 2), α_cross_max
    # the largest cosine similarity across its two parts. 0: kept whenever α_cross_max < 1 (the reference code
    # has no such check).
    gamma_max: float = 0.0
    # The smallest cluster that may split (the reference code's len(idc) > 2).
    min_split_size: int = 3
    # The first training round whose close may split a cluster (the reference code's c_round > 20).
    split_from_round: int = 21
    # "single": the paper's optimal bipartition (merge the most similar pairs until two clusters are
    # left, which minimises the largest similarity across the parts); "complete": the reference code's
    # sklearn AgglomerativeClustering(linkage="complete") on −α.
    linkage: Linkage = "single"
    # "examples": the cluster's update weighted by |D_i| / |D_c| (the paper); "uniform": the plain mean of its
    # members' updates (the reference code's reduce_add_average).
    weighting: Literal["examples", "uniform"] = "examples"
    local_epochs: int = 1
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    lr_decay: float = 0.99
    lr_decay_from: int = 1
    keep_optimizer_state: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(math.isfinite(self.eps1) and self.eps1 >= 0, f"eps1 must be a finite number >= 0, got {self.eps1}")
        check(math.isfinite(self.eps2) and self.eps2 >= 0, f"eps2 must be a finite number >= 0, got {self.eps2}")
        check(0 <= self.gamma_max < 1, f"gamma_max must be in [0, 1), got {self.gamma_max}")
        check(self.min_split_size >= 2, f"min_split_size must be >= 2, got {self.min_split_size}")
        check(self.split_from_round >= 1, f"split_from_round must be >= 1, got {self.split_from_round}")
        check(self.linkage in ("single", "complete"),
              f"linkage must be 'single' or 'complete', got {self.linkage!r}")
        check(self.weighting in ("examples", "uniform"),
              f"weighting must be 'examples' or 'uniform', got {self.weighting!r}")


SPEC = AlgorithmSpec(
    name="cfl",
    summary="Clustered FL (Sattler et al. 2020): FedAvg of weight updates within clusters of organizations, a "
    "cluster split in two by the cosine similarity of its members' updates once its FedAvg stalls; each "
    "organization receives its cluster's model.",
    config_type=CFLConfig,
    upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    download=frozenset({K.MODEL_WEIGHTS}),
    setup_upload=frozenset({K.MODEL_WEIGHTS}),
    shared_schema=frozenset({K.MODEL_WEIGHTS}),
    unsummed_because="the server clusters organizations by the cosine similarity of their own updates",
)
