"""FedFomo (Zhang, Sapra, Fidler, Yeung and Alvarez, ICLR 2021, "Personalized Federated Learning with First
Order Model Optimization"): the spec, its config and the server's ε-greedy choice of peers.

Every organization keeps a personalised model of one shared architecture. Each round the aggregator relays to
each organization the last trained models of up to ``peers_per_round`` other organizations, chosen ε-greedily
by the row of its affinity matrix P. The organization weighs each model θ_n (its own last trained model
included) by the loss improvement per unit of distance on its own validation split,

    w_n = (L(φ) − L(θ_n)) / ‖θ_n − φ‖₁,

φ its model before its last local training; moves φ ← φ + Σ_n ŵ_n (θ_n − φ) with ŵ_n = max(w_n, 0) / Σ max(w, 0)
(φ stays when no w_n is positive); trains locally; and sends its trained model and its w_n, which the aggregator
adds, normalised, to its row of P. Whole models cross the wire to peers: FedFomo is not model-private.

Defaults: the authors' code's (github:NVlabs/FedFomo, the README's "5 models" command), labelled in
docs/algorithms/fedfomo.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, Optimizer, TrainConfig


@dataclass(frozen=True)
class FedFomoConfig(TrainConfig):
    """FedFomo: how many peer models each organization receives, the ε-greedy exploration of the affinity
    matrix, the validation split the weights are measured on, and the local training (the reference code's)."""

    # Peer models an organization receives a round (--num_update_clients 4 of the README: its "5 models" are
    # these 4 and the organization's own).
    peers_per_round: int = 4
    # ε-greedy choice of peers: in round r each of the peers_per_round places is a uniformly random peer with
    # probability max(ε − (r − 1)·decay, 0), else the peer of highest affinity left (--client_weight_epsilon 0.3,
    # --client_weight_epsilon_decay 0.05).
    epsilon: float = 0.3
    epsilon_decay: float = 0.05
    # The affinity an organization starts with to itself (P = self_affinity·I; --client_initial_self_weight).
    self_affinity: float = 0.1
    # Share of the organization's training data held out as the validation split the weights are measured on
    # (--train_split 0.8).
    val_fraction: float = 0.2
    # Local training: 5 epochs (--federation_epoch 5) of SGD at lr 0.1 (--lr, --momentum 0.0, --bs_trn 50,
    # --weight_decay default 1e-4), the rate decayed by 0.99 after each round (--learning_rate_decay 0.99).
    local_epochs: int = 5
    batch_size: int = 50
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 1e-4
    optimizer: Optimizer = "sgd"
    lr_decay: float = 0.99
    lr_decay_from: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.peers_per_round >= 0, f"peers_per_round must be >= 0, got {self.peers_per_round}")
        check(0.0 <= self.epsilon <= 1.0, f"epsilon must be in [0, 1], got {self.epsilon}")
        check(self.epsilon_decay >= 0.0, f"epsilon_decay must be >= 0, got {self.epsilon_decay}")
        check(np.isfinite(self.self_affinity), f"self_affinity must be finite, got {self.self_affinity}")
        check(0.0 < self.val_fraction < 1.0, f"val_fraction must be in (0, 1), got {self.val_fraction}")

    def exploration(self, round_: int) -> float:
        """ε of training round ``round_`` (1-based): the reference code's ε − epoch·decay, its epoch 1 (the first
        that weighs models) being round 2 here."""
        return max(self.epsilon - (round_ - 1) * self.epsilon_decay, 0.0)


def choose_peers(affinity: np.ndarray, available: list[int], count: int, epsilon: float,
                 rng: np.random.Generator) -> list[int]:
    """Up to ``count`` of the ``available`` peers (indices into ``affinity``, the receiver's row of P), in the
    order chosen: for each place, with probability ``epsilon`` the next of a random shuffle of the peers, else the
    next of the peers by affinity, highest first, ties broken at random; a peer chosen already is passed over."""
    count = min(count, len(available))
    if count == 0:
        return []
    scores = np.asarray([affinity[i] for i in available], dtype=np.float64)
    ties = rng.random(len(available))
    by_affinity = [available[int(j)] for j in np.lexsort((ties, scores))[::-1]]
    shuffled = [available[int(j)] for j in rng.permutation(len(available))]
    chosen: list[int] = []
    for _ in range(count):
        explore = rng.uniform(0.0, 1.0) < epsilon
        source = shuffled if explore else by_affinity
        while True:
            peer = source.pop(0)
            if peer not in chosen:
                chosen.append(peer)
                break
    return chosen


SPEC = AlgorithmSpec(
    name="fedfomo",
    summary="FedFomo (Zhang et al. 2021): each organization receives peers' whole models, chosen e-greedily "
    "by affinity, and moves toward those that lower its validation loss, weighted by loss gain per distance.",
    config_type=FedFomoConfig,
    upload=frozenset({K.MODEL_WEIGHTS, K.PEER_WEIGHTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.MODEL_WEIGHTS, K.EVAL_METRICS}),
    download=frozenset({K.MODEL_WEIGHTS, K.PEER_WEIGHTS}),
    shared_schema=frozenset({K.MODEL_WEIGHTS}),
    repeated_download=frozenset({K.MODEL_WEIGHTS}),
    unsummed_because="the server sends each organization some of its peers' own models",
)
