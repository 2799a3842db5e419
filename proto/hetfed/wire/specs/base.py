"""What every algorithm spec is made of: the shared training config and the spec itself.

A spec says what crosses the wire and no more: an algorithm's name, its frozen config dataclass, the payload
kinds each side may send in each phase, what stays private and the figures its metrics carry. Its two halves
bind themselves to it by import (``@fedcma.SPEC.server_half`` on the server half's class, ``client_half`` on
the client's), so the link from a half to its spec is an import an editor follows; each side's package
imports its own halves only (``hetfed.aggregator.algorithms.registered``, ``hetfed.client.algorithms.registered``).
The aggregator (numpy) and the clients (torch) both read a spec; this module imports neither. Local-run defaults, labels, documentation
and reproduction grids are the experiment side's (``hetfed.cli.experiments``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from hetfed.wire.config import check, from_mapping
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.phases import Phase
from hetfed.wire.summation import SUMMABLE

if TYPE_CHECKING:
    from hetfed.wire.distributed import DistributedSum

WireDtype = Literal["float32", "float16", "bfloat16"]
Optimizer = Literal["sgd", "adam", "amsgrad"]


@dataclass(frozen=True)
class TrainConfig:
    """Local-training hyperparameters shared by every organization of a run.

    These defaults are the one set a run gets wherever it is written: ``hetfed run``, a hand-written
    aggregator file and the chart write only what someone chose, so all three train alike. An algorithm
    whose paper or authors trained otherwise declares its own values in its config (FedSR, FedH2L, SimFed)
    or in its spec's presets (Fed-CMA). The values here are hetfed's own choice for the baselines (FedAvg,
    Local and the algorithms that keep them): SGD at lr 0.01 with momentum 0.9, two epochs of batch 32.
    """

    local_epochs: int = 2
    # When > 0, each round runs exactly this many minibatch steps instead of local_epochs epochs.
    local_steps: int = 0
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer: Optimizer = "sgd"
    # Transport precision of floating tensors (float16/bfloat16 halve the bytes).
    wire_dtype: WireDtype = "float32"
    # A per-round learning-rate decay γ: training round t steps at lr·γ^max(t − lr_decay_from + 1, 0), every
    # optimiser built from this config alike. 1.0: a constant rate. FedGen's ExponentialLR(γ = 0.99) stepped
    # with the round index after each round's training (users/userbase.py:58, useravg.py:40-41) is γ = 0.99
    # from round 3 (rounds 1 and 2 at lr).
    lr_decay: float = 1.0
    lr_decay_from: int = 2
    # A cap on the L2 norm of each step's gradient, over every parameter an optimiser built from this config
    # steps (torch's clip_grad_norm_ before the step). 0.0: no cap, as every paper here trains.
    max_grad_norm: float = 0.0
    # Keep each organization's optimisers (their SGD momentum) from round to round, and across a restart,
    # instead of fresh ones every round: what reference implementations that build their optimiser once do.
    keep_optimizer_state: bool = False

    def distributed_sum(self, clients: int, rounds: int) -> DistributedSum | None:
        """Under secure aggregation, the summed kind that goes through distributed DP
        (``hetfed.wire.distributed``) for a run of ``clients`` organizations and ``rounds`` training rounds; None
        (the default): every summed kind takes the secure sum's own encoding."""
        return None

    def lr_factor(self, round_: int) -> float:
        """The factor on every base learning rate in training round ``round_`` (1-based)."""
        return float(self.lr_decay ** max(round_ - self.lr_decay_from + 1, 0))

    def __post_init__(self) -> None:
        check(self.local_epochs >= 1, f"local_epochs must be >= 1, got {self.local_epochs}")
        check(self.local_steps >= 0, f"local_steps must be >= 0, got {self.local_steps}")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        check(0 < self.lr_decay <= 1, f"lr_decay must be in (0, 1], got {self.lr_decay}")
        check(self.lr_decay_from >= 1, f"lr_decay_from must be >= 1, got {self.lr_decay_from}")
        check(self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm),
              f"max_grad_norm must be a finite number >= 0 (0: no cap), got {self.max_grad_norm}")


@dataclass(frozen=True)
class PeriodicEvalConfig(TrainConfig):
    """A config that lets the client's round loop evaluate only every ``eval_every`` rounds.

    Rounds in between resend the last evaluation's figures (their ``evaluated_round`` says when it was taken);
    the final model is always evaluated. Configs without it are evaluated every round.
    """

    eval_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}")


@dataclass(frozen=True)
class SharedSpaceConfig(TrainConfig):
    """A run whose organizations map into one latent space and one label space: their widths are the run's.

    ``hetfed run`` sets them from the data (classes) and the model choice (latent width); the client runtime
    builds every encoder to ``latent_dim`` unless the organization's model config says otherwise.
    """

    latent_dim: int = 32
    num_classes: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.latent_dim >= 1, f"latent_dim must be >= 1, got {self.latent_dim}")
        check(self.num_classes >= 2, f"num_classes must be >= 2, got {self.num_classes}")


C = TypeVar("C", bound=TrainConfig)
T = TypeVar("T", bound=type)
SIDES = ("server", "client")
# (family, side) -> the half class bound to it. A preset shares its family's halves; a derived spec (FedProx
# from FedAvg) is a family of its own and binds its halves itself.
_HALVES: dict[tuple[str, str], type] = {}


@dataclass(frozen=True)
class Figure:
    """A figure an algorithm reports, exported by the aggregator under ``key`` (means over organizations too).

    ``source`` names the per-organization metric it is read from: ``test_accuracy`` or a key of the
    reports' extra figures (for example ``cross_test_accuracy``, which data with domains provides). How a
    figure is labelled for people is the experiment side's (``hetfed.cli.experiments``).
    """

    key: str
    source: str


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
    # Upload kinds the server half only sums, weighted (``hetfed.wire.summation``): what secure aggregation
    # carries in a training round. Empty: the algorithm needs individual payloads and cannot run under it.
    summed_upload: frozenset[PayloadKind] = frozenset()
    # Why the algorithm cannot run under secure aggregation, where it declares no summed upload (one clause, the
    # refusal's reason: "the server relays each organization's posteriors to its peers").
    unsummed_because: str = ""
    # Download kinds the aggregator may send several of in one instructions message (relays).
    repeated_download: frozenset[PayloadKind] = frozenset()
    # True when no encoder weights may ever leave an organization.
    model_private: bool = False
    # True when organizations may bring different architectures although weights cross the wire: the model the
    # server averages is one of the algorithm's own, of one architecture for the run, kept beside each
    # organization's model (FML's meme model). A model-private algorithm allows them anyway.
    own_architectures: bool = False
    # True when encoders must end in a sigmoid so z lies in [0, 1]^d_e, unless the config's own
    # ``bounded_latent`` field says otherwise (``latent_bounded`` reads both).
    bounded_latent: bool = False
    # True when every organization must hold the run's shared seed set (its id and SHA-256 are checked at Join).
    needs_seed_set: bool = False
    # True when every organization must count the same classes, or feed inputs of the same shape: the first
    # organization to declare its num_classes (input_shape) at Join fixes the run's, others are refused
    # (data_mismatch). False where organizations share no head (their own label spaces), or nothing at all.
    shared_label_space: bool = True
    shared_input_shape: bool = True
    # Figures the algorithm's metrics carry beyond accuracy (the aggregator exports them by key).
    figures: tuple[Figure, ...] = ()
    # Only for an algorithm kept outside hetfed, whose spec no side's package imports: its halves as
    # "module:Class" (the server half numpy, in the aggregator; the client half torch), imported by the side
    # that runs them. hetfed's own halves bind by import instead (``server_half``, ``client_half``).
    server: str = ""
    client: str = ""
    # Config fields this name sets over the config type's defaults (a preset of another algorithm's config).
    presets: Mapping[str, Any] = field(default_factory=dict)
    # The algorithm this spec is a preset of ("" for an algorithm of its own).
    preset_of: str = ""

    def __post_init__(self) -> None:
        if not self.required_upload <= self.upload:
            raise ValueError(f"{self.name}: required uploads must be allowed uploads")
        if PayloadKind.EVAL_METRICS not in self.upload:
            raise ValueError(f"{self.name}: every algorithm reports EvalMetrics")
        if not self.summed_upload <= self.upload - _METRICS:
            raise ValueError(f"{self.name}: summed uploads must be allowed uploads other than EvalMetrics")
        if not self.summed_upload <= SUMMABLE:
            raise ValueError(f"{self.name}: {sorted(k.value for k in self.summed_upload - SUMMABLE)} have no summed form")
        if self.summed_upload and self.unsummed_because:
            raise ValueError(f"{self.name}: a spec with summed uploads gives no reason for needing each payload")
        if not self.repeated_download <= self.download:
            raise ValueError(f"{self.name}: repeated download kinds must be download kinds")
        if not dataclasses.is_dataclass(self.config_type) or not issubclass(self.config_type, TrainConfig):
            raise ValueError(f"{self.name}: config_type must be a TrainConfig dataclass")
        for side, ref in (("server", self.server), ("client", self.client)):
            module, _, cls = ref.partition(":")
            if ref and (not module or not cls):
                raise ValueError(f"{self.name}: {side} must name its half as 'module:Class', got {ref!r}")
        self.config()  # the presets are fields of the config type, with valid values

    def uploads(self, phase: Phase, secure: bool = False) -> tuple[frozenset[PayloadKind], frozenset[PayloadKind]]:
        """(allowed, required) upload kinds in ``phase``; under secure aggregation (``secure``) a training update
        carries its masked input instead of the summed kinds (``summed_upload``)."""
        if phase is Phase.SETUP:
            return self.setup_upload, self.setup_upload
        if phase is Phase.TRAIN and secure:
            masked = frozenset({PayloadKind.SECAGG_MASKED_INPUT})
            return (self.upload - self.summed_upload) | masked, (self.required_upload - self.summed_upload) | masked
        if phase is Phase.TRAIN:
            return self.upload, self.required_upload
        if phase is Phase.EVALUATE:
            return _METRICS, _METRICS
        return frozenset(), frozenset()

    @property
    def mixed_architectures(self) -> bool:
        """Whether the organizations of a run may bring different architectures (``model``): none of them sends
        its model's weights (``model_private``), or what is averaged is a model of the algorithm's own."""
        return self.model_private or self.own_architectures

    def latent_bounded(self, config: TrainConfig | None = None) -> bool:
        """Whether this run's encoders end in a sigmoid: the config's ``bounded_latent`` field where the
        algorithm's config has one, else the spec's."""
        own = getattr(config, "bounded_latent", None)
        return self.bounded_latent if own is None else bool(own)

    def secure_aggregation_refusal(self) -> str:
        """Why this algorithm cannot run with ``secure_aggregation = true`` (one line), or "" when it can."""
        if self.summed_upload:
            return ""
        why = self.unsummed_because or "it needs each organization's own payloads (it declares no summed upload)"
        return f"algorithm {self.name!r} cannot run with secure_aggregation = true: {why}"

    @property
    def first_phase(self) -> Phase:
        """Setup when the algorithm uploads something once before round 1, else training."""
        return Phase.SETUP if self.setup_upload else Phase.TRAIN

    @property
    def family(self) -> str:
        """The algorithm whose halves and documentation this spec shares: itself, or the one it presets."""
        return self.preset_of or self.name

    def config(self, **fields: Any) -> C:
        """A config instance (validated by the dataclass): the presets, then ``fields``."""
        return self.config_type(**{**self.presets, **fields})

    def parse(self, data: Mapping[str, Any], where: str = "config") -> C:
        """The typed config from a table (TOML, JSON): the presets, then the table's fields, checked."""
        return from_mapping(self.config_type, {**self.presets, **data}, where)

    def derive(self, **changes: Any) -> AlgorithmSpec[Any]:
        """A new spec from this one (for example FedProx from FedAvg: another name, config type and client)."""
        return dataclasses.replace(self, **changes)

    def server_half(self, half: T) -> T:
        """Class decorator: ``half`` is this algorithm's server half (its presets' too)."""
        return self._bind("server", half)

    def client_half(self, half: T) -> T:
        """Class decorator: ``half`` is this algorithm's client half (its presets' too)."""
        return self._bind("client", half)

    def _bind(self, side: str, half: T) -> T:
        bound = _HALVES.setdefault((self.family, side), half)
        if bound is not half:
            raise ValueError(f"algorithm {self.family!r} has a {side} half already: {bound.__qualname__}, "
                             f"not {half.__qualname__}")
        return half

    def half(self, side: str) -> type | None:
        """The class bound as this algorithm's ``side`` half ("server" or "client"), if its module was imported."""
        return _HALVES.get((self.family, side))

    def preset(self, name: str, summary: str, **fields: Any) -> AlgorithmSpec[C]:
        """This algorithm under another name whose config defaults are ``fields`` (same halves, same wire)."""
        return dataclasses.replace(self, name=name, summary=summary, presets={**self.presets, **fields},
                                   preset_of=self.family)
