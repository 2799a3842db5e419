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
    optimizer: Literal["sgd", "adam"] = "sgd"
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
    )
}


def get_spec(name: str) -> AlgorithmSpec:
    """The spec registered under ``name``; a clear error lists the known algorithms."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(sorted(SPECS))}") from None
