"""Communication-cost accounting where messages are serialized: bytes, messages and tensor elements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter

from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire import codec
from hetfed.wire.framing import WIRE_LEN, fields

LABELS = ("run", "algorithm", "organization", "direction", "payload_kind")


class Direction(StrEnum):
    """Which way a message travels: up from an organization to the aggregator, or down to it.

    A string enum: its values are the ``direction`` label of every metric and of Status's traffic counts.
    """

    UP = "up"
    DOWN = "down"

ENVELOPE = "envelope"


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def embedded_size(message_size: int) -> int:
    """Bytes a length-delimited sub-message of ``message_size`` bytes takes in its parent (tag + length)."""
    return 1 + _varint_len(message_size) + message_size


@dataclass
class KindCount:
    """Bytes, messages and tensor elements of one payload kind in one direction."""

    bytes: int = 0
    messages: int = 0
    elements: int = 0


@dataclass
class TrafficBreakdown:
    """Per-kind counts of one message; ``envelope`` holds every byte not inside a payload."""

    kinds: dict[str, KindCount] = field(default_factory=dict)

    def add(self, other: TrafficBreakdown) -> None:
        """Accumulate another breakdown into this one."""
        for k, c in other.kinds.items():
            mine = self.kinds.setdefault(k, KindCount())
            mine.bytes += c.bytes
            mine.messages += c.messages
            mine.elements += c.elements

    @property
    def total_bytes(self) -> int:
        """All bytes, payloads and envelope together."""
        return sum(c.bytes for c in self.kinds.values())


def field_sizes(data: bytes | memoryview, number: int) -> list[int]:
    """The lengths of every length-delimited field ``number`` at the top level of a serialized message.

    Reads only the tags and lengths of the top-level fields (a few varints for a whole update), so a message
    whose bytes are at hand is measured without serializing it again: protobuf's ``ByteSize()`` encodes the
    whole message (upb), as costly as ``SerializeToString()``. Raises ``ValueError`` on bytes that are not a
    well-formed message.
    """
    with memoryview(data) as whole, whole.cast("B") as view:
        return [end - value for n, wire_type, _, value, end in fields(view) if n == number and wire_type == WIRE_LEN]


def payload_breakdown(payloads: Sequence[pb.Payload], sizes: Sequence[int] | None = None) -> TrafficBreakdown:
    """Bytes, messages and elements of each payload kind, without the envelope (see ``with_envelope``).

    ``sizes``: each payload's serialized length when known (``field_sizes`` of the message's bytes);
    otherwise protobuf computes it, which serializes the payload once more.
    """
    if sizes is not None and len(sizes) != len(payloads):
        raise ValueError(f"{len(sizes)} sizes for {len(payloads)} payloads")
    out = TrafficBreakdown()
    for i, p in enumerate(payloads):
        c = out.kinds.setdefault(p.WhichOneof("kind") or "unknown", KindCount())
        c.bytes += embedded_size(p.ByteSize() if sizes is None else sizes[i])
        c.messages += 1
        c.elements += codec.tensor_elements(p)
    return out


def with_envelope(payloads: TrafficBreakdown, wire_bytes: int, messages: int = 1) -> TrafficBreakdown:
    """A copy of a payload breakdown whose ``envelope`` holds the rest of ``wire_bytes``."""
    out = TrafficBreakdown({k: KindCount(c.bytes, c.messages, c.elements) for k, c in payloads.kinds.items()})
    env = out.kinds.setdefault(ENVELOPE, KindCount())
    env.bytes += max(0, wire_bytes - payloads.total_bytes)
    env.messages += messages
    return out


def breakdown(payloads: Sequence[pb.Payload], wire_bytes: int, messages: int = 1) -> TrafficBreakdown:
    """Attribute ``wire_bytes`` (the serialized gRPC messages) to payload kinds and the envelope."""
    return with_envelope(payload_breakdown(payloads), wire_bytes, messages)


SIDES = ("aggregator", "client")


class TrafficMetrics:
    """Prometheus counters of the traffic one side counted, labelled by run, algorithm, organization, direction, kind.

    The side is part of the family name (``hetfed_aggregator_bytes_total``, ``hetfed_client_bytes_total``): both
    sides count every message, so one family summed over all its labels is the wire total, never twice it.
    """

    def __init__(self, registry: CollectorRegistry, side: str) -> None:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self.bytes = Counter(
            f"hetfed_{side}_bytes", f"Serialized bytes of gRPC messages the {side} counted, by payload kind", LABELS,
            registry=registry,
        )
        self.messages = Counter(f"hetfed_{side}_messages", f"Messages the {side} counted (payloads; envelopes "
                                "per gRPC message)", LABELS, registry=registry)
        self.parameters = Counter(
            f"hetfed_{side}_parameters", f"Tensor elements carried by payloads the {side} counted", LABELS,
            registry=registry,
        )

    def record(self, run: str, algorithm: str, organization: str, direction: str, b: TrafficBreakdown) -> None:
        """Add one message's breakdown to the counters."""
        for kind, c in b.kinds.items():
            labels = (run, algorithm, organization, direction, kind)
            self.bytes.labels(*labels).inc(c.bytes)
            self.messages.labels(*labels).inc(c.messages)
            if c.elements:
                self.parameters.labels(*labels).inc(c.elements)
