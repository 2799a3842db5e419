"""Typed, numpy-backed payloads: what algorithm code sees instead of Protobuf messages."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

import numpy as np

from hetfed import secagg
from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire.errors import WireError


class PayloadKind(enum.Enum):
    """The kinds of payload that may cross the wire; values are the Payload oneof field names."""

    MODEL_WEIGHTS = "model_weights"
    HEAD_WEIGHTS = "head_weights"
    CLASS_COUNTS = "class_counts"
    CLASS_MEAN_EMBEDDINGS = "class_mean_embeddings"
    SEED_POSTERIORS = "seed_posteriors"
    FACTORIZED_WEIGHTS = "factorized_weights"
    CRITERIA_EMBEDDINGS = "criteria_embeddings"
    EVAL_METRICS = "eval_metrics"
    PEER_WEIGHTS = "peer_weights"
    # Secure aggregation's stage messages (``hetfed.secagg``), each counted as its own kind.
    SECAGG_SETUP = "secagg_setup"
    SECAGG_KEY_ADVERT = "secagg_key_advert"
    SECAGG_PEER_KEYS = "secagg_peer_keys"
    SECAGG_SHARED_KEYS = "secagg_shared_keys"
    SECAGG_PEER_SHARES = "secagg_peer_shares"
    SECAGG_MASKED_INPUT = "secagg_masked_input"
    SECAGG_UNMASK = "secagg_unmask"

    @property
    def proto_enum(self) -> int:
        """The matching hetfed.v1.PayloadKind enum number."""
        return int(pb.PayloadKind.Value("PAYLOAD_KIND_" + self.name))

    @classmethod
    def from_proto_enum(cls, value: int) -> PayloadKind:
        """The PayloadKind for a hetfed.v1.PayloadKind enum number."""
        try:
            return cls[pb.PayloadKind.Name(value).removeprefix("PAYLOAD_KIND_")]
        except (ValueError, KeyError):
            raise ValueError(f"{value} is not a known payload kind") from None


@dataclass(frozen=True)
class ModelWeights:
    """Weights of a whole shared model, by parameter name."""

    tensors: dict[str, np.ndarray]
    num_examples: int = 0
    kind = PayloadKind.MODEL_WEIGHTS


@dataclass(frozen=True)
class HeadWeights:
    """The classification head Linear(d_e, K): weight [K, d_e] and bias [K]."""

    weight: np.ndarray
    bias: np.ndarray
    num_examples: int = 0
    kind = PayloadKind.HEAD_WEIGHTS


@dataclass(frozen=True)
class ClassCounts:
    """Local training examples per class, int64 [K]."""

    counts: np.ndarray
    kind = PayloadKind.CLASS_COUNTS


@dataclass(frozen=True)
class ClassMeanEmbeddings:
    """Class-conditional mean embeddings with per-class counts and presence."""

    labels: np.ndarray
    means: np.ndarray
    counts: np.ndarray
    presence: np.ndarray
    kind = PayloadKind.CLASS_MEAN_EMBEDDINGS


@dataclass(frozen=True)
class SeedPosteriors:
    """A node's posteriors on a batch of the shared seed set, with its teaching confidence (FedMD: logits in
    ``probabilities``, the confidence unused)."""

    seed_set_id: str
    indices: np.ndarray
    probabilities: np.ndarray
    teaching_confidence: float
    source_organization: str = ""
    kind = PayloadKind.SEED_POSTERIORS


@dataclass(frozen=True)
class FactorizedLayer:
    """One layer as W = u x v (+) mask, the mask sparse as flat indices and values."""

    name: str
    u: np.ndarray
    v: np.ndarray
    mask_indices: np.ndarray
    mask_values: np.ndarray
    mask_shape: tuple[int, ...]


@dataclass(frozen=True)
class FactorizedWeights:
    """Every factorised layer of a model."""

    layers: tuple[FactorizedLayer, ...]
    num_examples: int = 0
    kind = PayloadKind.FACTORIZED_WEIGHTS


@dataclass(frozen=True)
class CriteriaEmbeddings:
    """A model's embeddings of the shared criteria inputs, [B, D]."""

    criteria_set_id: str
    embeddings: np.ndarray
    kind = PayloadKind.CRITERIA_EMBEDDINGS


@dataclass(frozen=True)
class PeerWeights:
    """One weight per named organization (FedFomo): down, the peers whose models follow in the message, in
    their order, with the receiver's affinity to each; up, the sender's weight of each model it weighed."""

    organizations: tuple[str, ...]
    weights: np.ndarray
    kind = PayloadKind.PEER_WEIGHTS


@dataclass(frozen=True)
class SecAggSetup:
    """Stage 0, aggregator to client: the round's secure aggregation (roster, graph, threshold, encoding), and
    whether the summed payloads' weights are all 1 (``hetfed.wire.summation``)."""

    config: secagg.RoundConfig
    unit_weights: bool = False
    kind = PayloadKind.SECAGG_SETUP


@dataclass(frozen=True)
class SecAggKeyAdvert:
    """Stage 1, client to aggregator: its two public keys."""

    message: secagg.KeyAdvert
    kind = PayloadKind.SECAGG_KEY_ADVERT


@dataclass(frozen=True)
class SecAggPeerKeys:
    """Stage 1, aggregator to client: its neighbours' adverts."""

    message: secagg.PeerKeys
    kind = PayloadKind.SECAGG_PEER_KEYS


@dataclass(frozen=True)
class SecAggSharedKeys:
    """Stage 2, client to aggregator: its sealed shares, one per neighbour."""

    message: secagg.SharedKeys
    kind = PayloadKind.SECAGG_SHARED_KEYS


@dataclass(frozen=True)
class SecAggPeerShares:
    """Stage 2, aggregator to client: the sealed shares addressed to it."""

    message: secagg.PeerShares
    kind = PayloadKind.SECAGG_PEER_SHARES


@dataclass(frozen=True)
class SecAggMaskedInput:
    """Stage 3, client to aggregator: its masked ring vector."""

    message: secagg.MaskedInput
    kind = PayloadKind.SECAGG_MASKED_INPUT


@dataclass(frozen=True)
class SecAggUnmask:
    """Stage 4: the aggregator's request down, or the client's reply up."""

    message: secagg.UnmaskRequest | secagg.UnmaskReply
    kind = PayloadKind.SECAGG_UNMASK


SECAGG_KINDS = frozenset({PayloadKind.SECAGG_SETUP, PayloadKind.SECAGG_KEY_ADVERT, PayloadKind.SECAGG_PEER_KEYS,
                          PayloadKind.SECAGG_SHARED_KEYS, PayloadKind.SECAGG_PEER_SHARES,
                          PayloadKind.SECAGG_MASKED_INPUT, PayloadKind.SECAGG_UNMASK})


WITHHELD = "withheld"
"""How results, tables and reports show a figure an organization withheld under its privacy settings
(docs/privacy.md): never 0, and never averaged in."""


@dataclass(frozen=True)
class EvalMetrics:
    """Training and evaluation figures a client reports for a round.

    ``withheld`` names the figures computed from private data that the organization did not send (under its
    ``[privacy]``, docs/privacy.md): fixed fields (``FIELDS``) and extra keys. A withheld field holds 0, which
    means "withheld", never 0; a withheld extra key is absent from ``extra``. ``figure`` reads either kind."""

    train_loss: float = 0.0
    num_train_examples: int = 0
    test_accuracy: float = 0.0
    test_loss: float = 0.0
    num_test_examples: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    withheld: tuple[str, ...] = ()
    kind = PayloadKind.EVAL_METRICS

    FIELDS: ClassVar[tuple[str, ...]] = ("train_loss", "num_train_examples", "test_accuracy", "test_loss",
                                         "num_test_examples")

    def figure(self, name: str) -> float | None:
        """The figure ``name`` (a fixed field or an extra key); None when it was withheld or not reported."""
        if name in self.withheld:
            return None
        if name in self.FIELDS:
            return float(getattr(self, name))
        return self.extra.get(name)

    def is_withheld(self, name: str) -> bool:
        """Whether the organization withheld the figure ``name``."""
        return name in self.withheld


# Every payload type, each declaring its kind: the codec derives its tables from this union (a new kind is a
# message in payloads.proto, a PayloadKind member, its dataclass here and its pair in hetfed.wire.codec).
Payload = (
    ModelWeights
    | HeadWeights
    | ClassCounts
    | ClassMeanEmbeddings
    | SeedPosteriors
    | FactorizedWeights
    | CriteriaEmbeddings
    | EvalMetrics
    | PeerWeights
    | SecAggSetup
    | SecAggKeyAdvert
    | SecAggPeerKeys
    | SecAggSharedKeys
    | SecAggPeerShares
    | SecAggMaskedInput
    | SecAggUnmask
)


def named_tensors(payload: Payload) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor a payload carries, with a stable name (used by contract checks)."""
    if isinstance(payload, ModelWeights):
        yield from payload.tensors.items()
    elif isinstance(payload, HeadWeights):
        yield "weight", payload.weight
        yield "bias", payload.bias
    elif isinstance(payload, ClassCounts):
        yield "counts", payload.counts
    elif isinstance(payload, ClassMeanEmbeddings):
        yield "labels", payload.labels
        yield "means", payload.means
        yield "counts", payload.counts
        yield "presence", payload.presence
    elif isinstance(payload, SeedPosteriors):
        yield "indices", payload.indices
        yield "probabilities", payload.probabilities
    elif isinstance(payload, FactorizedWeights):
        for layer in payload.layers:
            yield f"{layer.name}.u", layer.u
            yield f"{layer.name}.v", layer.v
            yield f"{layer.name}.mask_indices", layer.mask_indices
            yield f"{layer.name}.mask_values", layer.mask_values
    elif isinstance(payload, CriteriaEmbeddings):
        yield "embeddings", payload.embeddings
    elif isinstance(payload, PeerWeights):
        yield "weights", payload.weights
    elif isinstance(payload, SecAggMaskedInput):
        yield "vector", payload.message.vector


def training_examples(payload: Payload) -> int | None:
    """The training-example count a payload claims (an aggregation weight or a report), if it carries one."""
    if isinstance(payload, ModelWeights | HeadWeights | FactorizedWeights):
        return payload.num_examples
    if isinstance(payload, EvalMetrics):
        return payload.num_train_examples
    return None


class Kinded(Protocol):
    """A payload class: it declares the kind it carries."""

    kind: PayloadKind


P = TypeVar("P", bound=Kinded)


class Received:
    """The payloads of one message with typed access by class: ``received.get(ClassCounts)``.

    Each kind appears at most once, except the kinds in ``repeated`` (relays, e.g. one SeedPosteriors per
    teacher), which ``all`` returns in order. A message breaking that is malformed (WireError).
    """

    def __init__(self, payloads: Iterable[Payload], repeated: frozenset[PayloadKind] = frozenset()) -> None:
        self._items: dict[PayloadKind, list[Payload]] = {}
        for p in payloads:
            got = self._items.setdefault(p.kind, [])
            if got and p.kind not in repeated:
                raise WireError("duplicate_payload", f"two {p.kind.value} payloads in one message")
            got.append(p)

    def get(self, cls: type[P]) -> P:
        """The one payload of type ``cls``; WireError(missing_payload) when absent."""
        kind = cls.kind
        items = self._items.get(kind)
        if not items:
            raise WireError("missing_payload", f"the message carries no {kind.value} payload")
        return items[0]  # type: ignore[return-value]

    def maybe(self, cls: type[P]) -> P | None:
        """The payload of type ``cls``, or None."""
        items = self._items.get(cls.kind)
        return items[0] if items else None  # type: ignore[return-value]

    def all(self, cls: type[P]) -> tuple[P, ...]:
        """Every payload of type ``cls``, in the order received."""
        return tuple(self._items.get(cls.kind, ()))  # type: ignore[arg-type]

    @property
    def kinds(self) -> frozenset[PayloadKind]:
        """The kinds present."""
        return frozenset(self._items)

    def __iter__(self) -> Iterator[Payload]:
        for items in self._items.values():
            yield from items

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())
