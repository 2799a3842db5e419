"""Algorithm specs: the declared wire contract of every algorithm, shared by aggregator and clients.

A spec binds an algorithm's name, its frozen config dataclass and the payload kinds each side may
send. The aggregator's server half (numpy) and the client's client half (torch) are registered
under the same name in their own packages; this module imports neither numpy-heavy nor torch code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K

WireDtype = Literal["float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class TrainConfig:
    """Local-training hyperparameters shared by every organization of a run."""

    local_epochs: int = 1
    # When > 0, each round runs exactly this many minibatch steps instead of local_epochs epochs.
    local_steps: int = 0
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: Literal["sgd", "adam", "amsgrad"] = "sgd"
    # Transport precision of floating tensors (float16/bfloat16 halve the bytes).
    wire_dtype: WireDtype = "float32"

    def __post_init__(self) -> None:
        check(self.local_epochs >= 1, f"local_epochs must be >= 1, got {self.local_epochs}")
        check(self.local_steps >= 0, f"local_steps must be >= 0, got {self.local_steps}")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class LocalConfig(TrainConfig):
    """Local training: no federation, metrics only."""


@dataclass(frozen=True)
class FedAvgConfig(TrainConfig):
    """FedAvg: the server averages whole models weighted by example counts."""


@dataclass(frozen=True)
class FedProxConfig(TrainConfig):
    """FedProx: FedAvg plus the proximal term (mu/2)·||w - w_global||² in the local objective."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.mu >= 0, f"mu must be >= 0, got {self.mu}")


@dataclass(frozen=True)
class HeadFedAvgConfig(TrainConfig):
    """Head-only FedAvg: only the classification head is averaged; encoders stay private."""


@dataclass(frozen=True)
class FedCMAConfig(TrainConfig):
    """Fed-CMA (class-conditional moment alignment, eqs. 5-7): latent width, label space and the λ's.

    The server's EMA steps are λ1·η (global head v̄) and λ2·η (global class means ē); the paper
    requires 0 < λη ≤ 1. The defaults λ1 = λ2 = 0.5, η = 0.9 give the reference code's step of 0.45.
    """

    # λ1: weight of the head-consensus term (λ1/2)·p_i·||v_i - v̄||² and of the server's head step.
    lambda1: float = 0.5
    # λ2: weight of the alignment term and of the server's class-mean step.
    lambda2: float = 0.5
    # η in eq. 7 (the server step): v̄ ← (1 - λ1η)·v̄ + λ1η·Σ p_i v_i, likewise ē with λ2.
    server_lr: float = 0.9
    # d_e and K: every organization's encoder maps into [0, 1]^d_e; the head is Linear(d_e, K).
    latent_dim: int = 32
    num_classes: int = 10
    # b: points per class in the fixed batches B_i^k (b_i^k = min(b, n_i^k)), chosen once per organization.
    class_batch_size: int = 16
    # "paper": eq. 5 over the fixed batches B_i^k with p weights; "reference": the reference code's form
    # (MSE between the current training batch's z and ē^k per class present, λ1·||v - v̄||², no p weights).
    alignment: Literal["paper", "reference"] = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lambda1", "lambda2"):
            step = getattr(self, name) * self.server_lr
            check(0 < step <= 1, f"{name}·server_lr must lie in (0, 1] (eq. 7), got {getattr(self, name)}·"
                                 f"{self.server_lr} = {step:g}")
        check(self.latent_dim >= 1, f"latent_dim must be >= 1, got {self.latent_dim}")
        check(self.num_classes >= 2, f"num_classes must be >= 2, got {self.num_classes}")
        check(self.class_batch_size >= 1, f"class_batch_size must be >= 1, got {self.class_batch_size}")


@dataclass(frozen=True)
class FedH2LConfig(TrainConfig):
    """FedH2L (Li et al., Algorithm 1, eqs. 1-14): mutual distillation on a shared seed set, relayed by the aggregator.

    ``lr`` is the local step size β and ``global_lr`` the mutual-learning step size η (0: same as lr); each
    step has its own optimiser (AMSGrad by default) with ``weight_decay``. ``batch_size`` is the size of the
    private batch and of every seed batch. ``local_steps`` is E: local steps per iteration, after which one
    global step uses g_loc = the displacement over those E steps (E = 1: the local gradient, eq. 2).
    The seed-set fraction α belongs to the data (``data.public_fraction``); ``seed_set_id`` names the seed
    set, whose id and SHA-256 the run config also checks at Join.
    """

    local_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 1e-4
    optimizer: Literal["sgd", "adam", "amsgrad"] = "amsgrad"
    global_lr: float = 0.0
    # Project g_pub against g_loc when they conflict (eq. 14); False is the paper's "no project" ablation.
    project: bool = True
    # Use the seed set's labels: ℓ_CE on the peers' seed batches and Acc_j as teaching confidence.
    # False: unlabelled seed data, KL only (the paper's Further Studies 2).
    labelled_seed: bool = True
    # Teachers per node and round: 0 = every peer; k > 0 = a seeded random subset of k peers (bounds traffic).
    peers_per_round: int = 0
    # Evaluate on the test sets every this many rounds (and in the final round); others resend the last figures.
    eval_every: int = 50
    # The seed set the posteriors refer to; non-empty: the aggregator rejects posteriors naming another.
    seed_set_id: str = ""
    # Number of seed-set examples (0: unchecked); indices must lie in [0, seed_set_size).
    seed_set_size: int = 0
    # organization -> [start, stop) of its domain's part of the seed set; when set, the aggregator rejects
    # posteriors on indices outside the sender's own part.
    teach_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.local_steps >= 1, f"local_steps (E) must be >= 1, got {self.local_steps}")
        check(self.global_lr >= 0, f"global_lr must be >= 0, got {self.global_lr}")
        check(self.peers_per_round >= 0, f"peers_per_round must be >= 0, got {self.peers_per_round}")
        check(self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}")
        check(self.seed_set_size >= 0, f"seed_set_size must be >= 0, got {self.seed_set_size}")
        for org, r in self.teach_ranges.items():
            check(len(r) == 2 and 0 <= r[0] < r[1], f"teach_ranges[{org}] must be [start, stop), got {list(r)}")
            check(not self.seed_set_size or r[1] <= self.seed_set_size,
                  f"teach_ranges[{org}] = {list(r)} exceeds seed_set_size {self.seed_set_size}")


@dataclass(frozen=True)
class AlgorithmSpec:
    """The declared contract of an algorithm: its config and the payload kinds each way."""

    name: str
    summary: str
    config_type: type[TrainConfig]
    # Kinds a client may upload in a training round; `required_upload` must all be present.
    upload: frozenset[K]
    required_upload: frozenset[K]
    # Kinds the aggregator may send down.
    download: frozenset[K]
    # Kinds uploaded once, before round 1 (empty: no setup phase).
    setup_upload: frozenset[K] = field(default_factory=frozenset)
    # Kinds whose tensors must match one schema across the run (declared at Join).
    shared_schema: frozenset[K] = field(default_factory=frozenset)
    # True when no encoder weights may ever leave an organization.
    model_private: bool = False
    # True when encoders must end in a sigmoid so z lies in [0, 1]^d_e (Fed-CMA's Assumption 2).
    bounded_latent: bool = False

    def __post_init__(self) -> None:
        if not self.required_upload <= self.upload:
            raise ValueError(f"{self.name}: required uploads must be allowed uploads")
        if K.EVAL_METRICS not in self.upload:
            raise ValueError(f"{self.name}: every algorithm reports EvalMetrics")


_M = frozenset({K.EVAL_METRICS})

SPECS: dict[str, AlgorithmSpec] = {
    s.name: s
    for s in (
        AlgorithmSpec(
            name="local",
            summary="Local training only; organizations report metrics and share nothing else.",
            config_type=LocalConfig,
            upload=_M,
            required_upload=_M,
            download=frozenset(),
            model_private=True,
        ),
        AlgorithmSpec(
            name="fedavg",
            summary="FedAvg (McMahan et al. 2017): weighted average of whole models.",
            config_type=FedAvgConfig,
            upload=_M | {K.MODEL_WEIGHTS},
            required_upload=_M | {K.MODEL_WEIGHTS},
            download=frozenset({K.MODEL_WEIGHTS}),
            shared_schema=frozenset({K.MODEL_WEIGHTS}),
        ),
        AlgorithmSpec(
            name="fedprox",
            summary="FedProx (Li et al. 2020): FedAvg with a proximal term in the local objective.",
            config_type=FedProxConfig,
            upload=_M | {K.MODEL_WEIGHTS},
            required_upload=_M | {K.MODEL_WEIGHTS},
            download=frozenset({K.MODEL_WEIGHTS}),
            shared_schema=frozenset({K.MODEL_WEIGHTS}),
        ),
        AlgorithmSpec(
            name="fedavg_head",
            summary="Head-only FedAvg (LG-FedAvg style): only the classifier head is averaged.",
            config_type=HeadFedAvgConfig,
            upload=_M | {K.HEAD_WEIGHTS},
            required_upload=_M | {K.HEAD_WEIGHTS},
            download=frozenset({K.HEAD_WEIGHTS}),
            shared_schema=frozenset({K.HEAD_WEIGHTS}),
            model_private=True,
        ),
        AlgorithmSpec(
            name="fedcma",
            summary="Fed-CMA: heterogeneous private encoders aligned by class-conditional latent means; "
            "only class counts (once), K×d_e class means and the head cross the wire.",
            config_type=FedCMAConfig,
            upload=_M | {K.CLASS_MEAN_EMBEDDINGS, K.HEAD_WEIGHTS},
            required_upload=_M | {K.CLASS_MEAN_EMBEDDINGS, K.HEAD_WEIGHTS},
            download=frozenset({K.CLASS_MEAN_EMBEDDINGS, K.HEAD_WEIGHTS}),
            setup_upload=frozenset({K.CLASS_COUNTS}),
            model_private=True,
            bounded_latent=True,
        ),
        AlgorithmSpec(
            name="fedh2l",
            summary="FedH2L: peer-to-peer mutual distillation on a shared seed set; only posteriors on seed "
            "batches and teaching confidences cross the wire, relayed (never aggregated) by the aggregator.",
            config_type=FedH2LConfig,
            upload=_M | {K.SEED_POSTERIORS},
            required_upload=_M | {K.SEED_POSTERIORS},
            download=frozenset({K.SEED_POSTERIORS}),
            model_private=True,
        ),
    )
}


def get_spec(name: str) -> AlgorithmSpec:
    """The spec registered under ``name``; a clear error lists the known algorithms."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(sorted(SPECS))}") from None
