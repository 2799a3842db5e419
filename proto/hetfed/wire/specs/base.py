"""What every algorithm spec is made of: the shared training config, the spec itself, local-run defaults.

A spec is data: an algorithm's name, its frozen config dataclass, the payload kinds each side may send in
each phase, the figures it reports and what ``hetfed run`` should use for it on each dataset. The aggregator
(numpy) and the clients (torch) both read it; this module imports neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.phases import Phase

WireDtype = Literal["float32", "float16", "bfloat16"]
Optimizer = Literal["sgd", "adam", "amsgrad"]


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
    optimizer: Optimizer = "sgd"
    # Transport precision of floating tensors (float16/bfloat16 halve the bytes).
    wire_dtype: WireDtype = "float32"

    def __post_init__(self) -> None:
        check(self.local_epochs >= 1, f"local_epochs must be >= 1, got {self.local_epochs}")
        check(self.local_steps >= 0, f"local_steps must be >= 0, got {self.local_steps}")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")


C = TypeVar("C", bound=TrainConfig)


@dataclass(frozen=True)
class Figure:
    """A figure an algorithm reports, shown by ``hetfed run`` as the mean over organizations.

    ``source`` names the per-organization metric it is read from: ``test_accuracy`` or a key of the
    reports' extra figures (for example ``cross_test_accuracy``, which data with domains provides).
    """

    key: str
    label: str
    source: str
    description: str = ""


@dataclass(frozen=True)
class LocalDefaults:
    """What ``hetfed run`` uses for an algorithm unless the user says otherwise; ``None`` leaves it open.

    ``config`` overrides fields of the algorithm's config (the training knobs included). ``partition`` is the
    data partition the algorithm needs by default; one ``hetfed run`` shares its data settings across runs.
    """

    rounds: int | None = None
    models: tuple[str, ...] = ()
    latent_dim: int | None = None
    partition: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)

    def over(self, base: LocalDefaults) -> LocalDefaults:
        """These defaults laid over ``base``: every field set here wins."""
        return LocalDefaults(
            rounds=self.rounds if self.rounds is not None else base.rounds,
            models=self.models or base.models,
            latent_dim=self.latent_dim if self.latent_dim is not None else base.latent_dim,
            partition=self.partition if self.partition is not None else base.partition,
            config={**base.config, **self.config},
        )


ANY_DATASET = "*"
_METRICS = frozenset({PayloadKind.EVAL_METRICS})


@dataclass(frozen=True)
class AlgorithmSpec(Generic[C]):
    """The declared contract of an algorithm: its config, the payload kinds each way, what it reports."""

    name: str
    summary: str
    config_type: type[C]
    # Kinds a client may upload in a training round; `required_upload` must all be present.
    upload: frozenset[PayloadKind]
    required_upload: frozenset[PayloadKind]
    # Kinds the aggregator may send down.
    download: frozenset[PayloadKind]
    # Kinds uploaded once, before round 1 (empty: no setup phase).
    setup_upload: frozenset[PayloadKind] = frozenset()
    # Kinds whose tensors must match one schema across the run (declared at Join).
    shared_schema: frozenset[PayloadKind] = frozenset()
    # Download kinds the aggregator may send several of in one instructions message (relays).
    repeated_download: frozenset[PayloadKind] = frozenset()
    # True when no encoder weights may ever leave an organization.
    model_private: bool = False
    # True when encoders must end in a sigmoid so z lies in [0, 1]^d_e.
    bounded_latent: bool = False
    # True when every organization must hold the run's shared seed set (its id and SHA-256 are checked at Join).
    needs_seed_set: bool = False
    # Figures the algorithm reports beyond accuracy, as means over organizations.
    figures: tuple[Figure, ...] = ()
    # ``hetfed run`` defaults by dataset name (``ANY_DATASET`` for every dataset; a dataset's entry wins).
    local_defaults: Mapping[str, LocalDefaults] = field(default_factory=dict)
    # The algorithm's page under docs/.
    docs: str = ""

    def __post_init__(self) -> None:
        if not self.required_upload <= self.upload:
            raise ValueError(f"{self.name}: required uploads must be allowed uploads")
        if PayloadKind.EVAL_METRICS not in self.upload:
            raise ValueError(f"{self.name}: every algorithm reports EvalMetrics")
        if not self.repeated_download <= self.download:
            raise ValueError(f"{self.name}: repeated download kinds must be download kinds")
        if not dataclasses.is_dataclass(self.config_type) or not issubclass(self.config_type, TrainConfig):
            raise ValueError(f"{self.name}: config_type must be a TrainConfig dataclass")

    def uploads(self, phase: Phase) -> tuple[frozenset[PayloadKind], frozenset[PayloadKind]]:
        """(allowed, required) upload kinds in ``phase``."""
        if phase is Phase.SETUP:
            return self.setup_upload, self.setup_upload
        if phase is Phase.TRAIN:
            return self.upload, self.required_upload
        if phase is Phase.EVALUATE:
            return _METRICS, _METRICS
        return frozenset(), frozenset()

    @property
    def first_phase(self) -> Phase:
        """Setup when the algorithm uploads something once before round 1, else training."""
        return Phase.SETUP if self.setup_upload else Phase.TRAIN

    def defaults_for(self, dataset: str) -> LocalDefaults:
        """The local-run defaults on ``dataset`` (its own entry over the every-dataset entry)."""
        base = self.local_defaults.get(ANY_DATASET, LocalDefaults())
        own = self.local_defaults.get(dataset)
        return own.over(base) if own is not None else base

    def config(self, **fields: Any) -> C:
        """A config instance (validated by the dataclass)."""
        return self.config_type(**fields)

    def derive(self, **changes: Any) -> AlgorithmSpec[Any]:
        """A new spec from this one (for example FedProx from FedAvg: another name and config type)."""
        return dataclasses.replace(self, **changes)
