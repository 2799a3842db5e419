"""Tests for hetfed.wire.traffic: exact byte attribution to payload kinds and the Prometheus counters."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, codec
from hetfed.wire.payloads import ClassCounts, EvalMetrics, HeadWeights, ModelWeights, Payload
from hetfed.wire.traffic import (
    ENVELOPE,
    KindCount,
    TrafficBreakdown,
    TrafficMetrics,
    breakdown,
    embedded_size,
    field_sizes,
    payload_breakdown,
)


@pytest.mark.parametrize(("size", "expected"), [
    (0, 2), (1, 3), (127, 129), (128, 131), (16383, 16386), (16384, 16388), (2**21 - 1, 2**21 + 3),
    (2**21, 2**21 + 5), (2**31, 2**31 + 6),
])
def test_embedded_size_is_tag_plus_varint_length_plus_body(size: int, expected: int) -> None:
    assert embedded_size(size) == expected


def test_embedded_size_matches_protobuf() -> None:
    for n in (0, 5, 126, 127, 128, 300, 20_000):
        parent = apb.PushUpdateRequest(chunk=apb.Chunk(data=b"x" * n))
        assert parent.ByteSize() == embedded_size(parent.chunk.ByteSize())


def make_update(payloads: list[Payload], round_: int = 3) -> apb.Update:
    return apb.Update(
        envelope=apb.Envelope(run_id="run-1", round=round_, organization_id="org-7",
                              payload_kinds=[p.kind.proto_enum for p in payloads]),
        payloads=[codec.payload_to_proto(p) for p in payloads],
    )


PAYLOADS: list[Payload] = [
    ModelWeights({"a.weight": np.ones((30, 20), np.float32), "a.bias": np.zeros(30, np.float32),
                  "steps": np.array(7, np.int64)}, num_examples=123),
    EvalMetrics(train_loss=0.25, num_train_examples=123, test_accuracy=0.5, extra={"x": 1.0}),
]


def test_update_bytes_are_attributed_exactly() -> None:
    update = make_update(PAYLOADS)
    wire = update.ByteSize()
    assert wire == len(update.SerializeToString())
    b = breakdown(list(update.payloads), wire)
    assert set(b.kinds) == {"model_weights", "eval_metrics", ENVELOPE}
    mw, em = update.payloads
    assert b.kinds["model_weights"] == KindCount(embedded_size(mw.ByteSize()), 1, 30 * 20 + 30 + 1)
    assert b.kinds["eval_metrics"] == KindCount(embedded_size(em.ByteSize()), 1, 0)
    # What is left is exactly the envelope field of the Update.
    assert b.kinds[ENVELOPE] == KindCount(embedded_size(update.envelope.ByteSize()), 1, 0)
    assert b.total_bytes == wire


def test_chunked_push_attributes_framing_to_the_envelope() -> None:
    update = make_update(PAYLOADS)
    requests = [apb.PushUpdateRequest(run_id="run-1", round=3, organization_id="org-7", chunk=c)
                for c in chunks.split(update.SerializeToString(), 1024)]
    assert len(requests) > 2
    wire = sum(r.ByteSize() for r in requests)
    b = breakdown(list(update.payloads), wire, messages=len(requests))
    assert b.total_bytes == wire  # sum over kinds == what was serialized
    payload_bytes = sum(embedded_size(p.ByteSize()) for p in update.payloads)
    assert b.kinds[ENVELOPE].bytes == wire - payload_bytes
    assert b.kinds[ENVELOPE].messages == len(requests)
    assert b.kinds["model_weights"].messages == 1
    # The envelope share: the Update's envelope plus every request's routing fields and chunk headers.
    per_request = sum(r.ByteSize() - len(r.chunk.data) for r in requests)
    assert b.kinds[ENVELOPE].bytes == per_request + embedded_size(update.envelope.ByteSize())


def test_an_rpc_without_payloads_is_all_envelope() -> None:
    b = breakdown([], 57, messages=2)
    assert b.kinds == {ENVELOPE: KindCount(57, 2, 0)}
    assert b.total_bytes == 57


def test_payloads_of_one_kind_accumulate() -> None:
    msgs = [codec.payload_to_proto(ClassCounts(np.arange(4))), codec.payload_to_proto(ClassCounts(np.arange(9)))]
    inside = sum(embedded_size(m.ByteSize()) for m in msgs)
    b = breakdown(msgs, inside + 10)
    assert b.kinds["class_counts"] == KindCount(inside, 2, 13)
    assert b.kinds[ENVELOPE] == KindCount(10, 1, 0)


def test_envelope_never_goes_negative() -> None:
    m = codec.payload_to_proto(HeadWeights(np.ones((2, 3), np.float32), np.ones(2, np.float32)))
    b = breakdown([m], 5)  # a caller that passes too few wire bytes
    assert b.kinds[ENVELOPE].bytes == 0
    assert b.total_bytes == embedded_size(m.ByteSize())


def test_breakdowns_add_up() -> None:
    total = TrafficBreakdown()
    one = breakdown([codec.payload_to_proto(PAYLOADS[1])], 200)
    total.add(one)
    total.add(one)
    assert total.kinds["eval_metrics"].messages == 2
    assert total.total_bytes == 400
    assert one.total_bytes == 200  # adding does not alias the counts


def test_metrics_record_every_kind_with_labels() -> None:
    registry = CollectorRegistry()
    metrics = TrafficMetrics(registry, "aggregator")
    update = make_update(PAYLOADS)
    b = breakdown(list(update.payloads), update.ByteSize() + 40, messages=3)
    metrics.record("run-1", "fedavg", "org-7", "up", b)
    metrics.record("run-1", "fedavg", "org-7", "up", b)

    def value(name: str, kind: str) -> float | None:
        return registry.get_sample_value(name, {"run": "run-1", "algorithm": "fedavg", "organization": "org-7",
                                                "direction": "up", "payload_kind": kind})

    for kind, c in b.kinds.items():
        assert value("hetfed_aggregator_bytes_total", kind) == 2 * c.bytes
        assert value("hetfed_aggregator_messages_total", kind) == 2 * c.messages
    assert value("hetfed_aggregator_parameters_total", "model_weights") == 2 * 631
    assert value("hetfed_aggregator_parameters_total", ENVELOPE) is None  # no elements, no series
    assert sum(value("hetfed_aggregator_bytes_total", k) or 0 for k in b.kinds) == 2 * (update.ByteSize() + 40)


def test_the_two_sides_count_in_distinct_families() -> None:
    registry = CollectorRegistry()
    aggregator, client = TrafficMetrics(registry, "aggregator"), TrafficMetrics(registry, "client")
    b = breakdown([], 50)
    aggregator.record("r", "fedavg", "o", "down", b)
    client.record("r", "fedavg", "o", "down", b)
    labels = {"run": "r", "algorithm": "fedavg", "organization": "o", "direction": "down", "payload_kind": ENVELOPE}
    assert registry.get_sample_value("hetfed_aggregator_bytes_total", labels) == 50
    assert registry.get_sample_value("hetfed_client_bytes_total", labels) == 50
    with pytest.raises(ValueError, match="side"):
        TrafficMetrics(registry, "both")


def test_field_sizes_are_the_payloads_serialized_lengths() -> None:
    update = make_update([*PAYLOADS, PAYLOADS[0]])
    data = update.SerializeToString()
    assert field_sizes(data, 2) == [p.ByteSize() for p in update.payloads]
    assert field_sizes(memoryview(data), 1) == [update.envelope.ByteSize()]
    assert field_sizes(data, 9) == []
    # Sizes read from the bytes attribute traffic exactly as protobuf's ByteSize() does.
    assert payload_breakdown(update.payloads, field_sizes(data, 2)) == payload_breakdown(update.payloads)


def test_field_sizes_skip_every_wire_type() -> None:
    # field 1 varint 300, field 3 fixed64, field 4 fixed32, field 5 a group holding a varint and a nested
    # length-delimited field, then field 2 twice (length 3 and length 0).
    data = (b"\x08\xac\x02" + b"\x19" + bytes(8) + b"\x25" + bytes(4)
            + b"\x2b" + b"\x08\x01" + b"\x12\x01x" + b"\x2c"
            + b"\x12\x03abc" + b"\x12\x00")
    assert field_sizes(data, 2) == [3, 0]
    assert field_sizes(data, 5) == []  # a group is not length-delimited


@pytest.mark.parametrize(("data", "why"), [
    (b"\x12\x05ab", "past the end"),          # a length beyond the message
    (b"\x08\x80", "varint"),                  # a varint cut short
    (b"\x19" + bytes(3), "past the end"),     # a fixed64 cut short
    (b"\x0c", "out of place"),                # an end-group tag with no group open
    (b"\x2b\x08\x01\x34", "another field"),   # a group closed by field 6's end-group tag
    (b"\x0e", "out of place"),                # wire type 6 does not exist
])
def test_field_sizes_refuse_malformed_bytes(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        field_sizes(data, 2)


def test_field_sizes_agree_with_protobuf_on_a_large_update() -> None:
    update = make_update([ModelWeights({"w": np.arange(300_000, dtype=np.float32)}, num_examples=5), PAYLOADS[1]])
    data = update.SerializeToString()
    assert field_sizes(data, 2) == [p.ByteSize() for p in update.payloads]
    assert embedded_size(field_sizes(data, 1)[0]) + sum(embedded_size(n) for n in field_sizes(data, 2)) == len(data)


def test_field_sizes_keep_no_reference_to_the_message() -> None:
    # A 4 MB update measured must be freed when its last reference goes, not at the next garbage collection
    # (a reference cycle holding the message grew every client by ~70 MB of updates waiting for the GC).
    import gc
    import weakref

    class Message(bytearray):
        pass

    data = Message(make_update(PAYLOADS).SerializeToString())
    ref = weakref.ref(data)
    gc.disable()
    try:
        assert field_sizes(data, 2)
        del data
        assert ref() is None
    finally:
        gc.enable()
