"""Tests for framing.lift: updates and instructions parsed by protobuf without their tensors' data, which is
decoded as read-only views of the received bytes. Protobuf's own parse of the whole message is the reference:
the lifted parse must accept exactly what it accepts and mean exactly what it means."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import codec, framing
from hetfed.wire.errors import WireError
from hetfed.wire.messages import (
    _ACTION_TO_PROTO,
    Instructions,
    ParsedUpdate,
    Update,
    decode_instructions,
    encode_instructions,
    encode_update,
)
from hetfed.wire.payloads import (
    ClassCounts,
    EvalMetrics,
    FactorizedLayer,
    FactorizedWeights,
    HeadWeights,
    ModelWeights,
    PayloadKind,
)
from hetfed.wire.phases import Action, Phase
from hetfed.wire.specs import get_spec
from tests.wire.test_codec import PAYLOADS, assert_same

TENSOR, DATA = tpb.Tensor.DESCRIPTOR, 3


def lifted_parse(cls: type[Message], raw: bytes, target: Any = TENSOR, number: int = DATA) -> Message:
    """``raw`` parsed the lifted way, with every lifted value put back (to compare with protobuf's parse)."""
    small, lifted = framing.lift(memoryview(raw), cls.DESCRIPTOR, target, number)
    msg = cls.FromString(small)
    restore(msg, lifted, target.full_name, target.fields_by_number[number].name)
    return msg


def restore(msg: Message, lifted: list[memoryview], target: str, name: str) -> None:
    """Put each lifted value back where its placeholder is (an empty field was absent: nothing was lifted)."""
    if msg.DESCRIPTOR.full_name == target and getattr(msg, name):
        value = getattr(msg, name)
        if isinstance(value, str):
            setattr(msg, name, bytes(framing.lifted_value(value.encode(), lifted)).decode())
        else:
            setattr(msg, name, bytes(framing.lifted_value(value, lifted)))
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            values = list(value.values()) if fd.message_type.fields_by_name["value"].message_type else []
        else:
            values = list(value) if fd.is_repeated else [value]
        for v in values:
            restore(v, lifted, target, name)


def protobuf_parse(cls: type[Message], raw: bytes) -> Message | None:
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


def lifted_or_none(cls: type[Message], raw: bytes) -> Message | None:
    try:
        return lifted_parse(cls, raw)
    except (ValueError, DecodeError):
        return None


def same(a: Message, b: Message) -> None:
    assert a == b
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)  # unknown fields too


def update_bytes(*payloads: Any) -> bytes:
    return bytes(encode_update(Update("run-1", 3, "org-é", list(payloads))).data)


# ---------------------------------------------------------------------- the same meaning as protobuf's parse


@pytest.mark.parametrize("kind", list(PayloadKind), ids=lambda k: k.value)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_payload_kind_parses_to_protobufs_message(kind: PayloadKind, data: st.DataObject) -> None:
    first, second = data.draw(PAYLOADS[kind]), data.draw(PAYLOADS[kind])
    for cls, raw in ((apb.Update, update_bytes(first, second)),
                     (apb.Instructions, bytes(encode_instructions(Instructions(
                         "run-1", 2, Action.TRAIN, 10, 7, "org-1", [first])).data))):
        same(lifted_parse(cls, raw), cls.FromString(raw))


def test_the_lifted_message_is_small_and_each_value_a_view_of_the_received_bytes() -> None:
    big = np.arange(50_000, dtype=np.float32)
    raw = update_bytes(ModelWeights({"w": big, "b": np.ones(3, np.float32)}, 5))
    small, lifted = framing.lift(memoryview(raw), apb.Update.DESCRIPTOR, TENSOR, DATA)
    assert len(small) < 200
    assert [v.nbytes for v in lifted] == [big.nbytes, 12]
    assert all(v.obj is raw for v in lifted)  # views, no copies
    assert bytes(lifted[0]) == big.tobytes()


def test_concatenated_messages_merge_as_protobuf_merges_them() -> None:
    # Protobuf reads a message repeated on the wire as one: repeated fields append, a singular message field
    # merges, and within it the last value of a scalar or bytes field wins.
    a = pb.Payload(head_weights=pb.HeadWeights(weight=tpb.Tensor(dtype=tpb.DTYPE_FLOAT32, shape=[1], data=b"\0" * 4),
                                               num_examples=3)).SerializeToString()
    b = pb.Payload(head_weights=pb.HeadWeights(weight=tpb.Tensor(data=b"\1\2\3\4"))).SerializeToString()
    merged = lifted_parse(pb.Payload, a + b)
    same(merged, pb.Payload.FromString(a + b))
    assert merged.head_weights.weight.data == b"\1\2\3\4" and merged.head_weights.num_examples == 3
    raw = update_bytes(HeadWeights(np.ones((2, 2), np.float32), np.zeros(2, np.float32), 4))
    same(lifted_parse(apb.Update, raw + raw), apb.Update.FromString(raw + raw))


def test_unknown_fields_and_fields_of_another_wire_type_are_protobufs_to_read() -> None:
    unknown = framing.tag(15, 0) + b"\x07" + framing.tag(16, 2) + b"\x02hi"
    tensor = (framing.tag(1, 0) + b"\x01" + unknown + framing.tag(2, 2) + b"\x01\x02"
              + framing.tag(3, 2) + b"\x08" + bytes(8) + unknown)
    as_varint = framing.tag(1, 0) + b"\x01" + framing.tag(2, 2) + b"\x01\x02" + framing.tag(3, 0) + b"\x05"
    for t in (tensor, as_varint):
        named = framing.tag(1, 2) + b"\x01w" + framing.tag(2, 2) + framing.write_varint(len(t)) + t
        weights = framing.tag(1, 2) + framing.write_varint(len(named)) + named + unknown
        raw = framing.tag(1, 2) + framing.write_varint(len(weights)) + weights + unknown  # Payload.model_weights
        same(lifted_parse(pb.Payload, raw), pb.Payload.FromString(raw))
    # The tensor whose data came as a varint has no data: decoding it is refused, as without lifting.
    small, lifted = framing.lift(memoryview(raw), pb.Payload.DESCRIPTOR, TENSOR, DATA)
    for message, views in ((pb.Payload.FromString(raw), None), (pb.Payload.FromString(small), lifted)):
        with pytest.raises(WireError, match="needs 8 bytes, got 0") as err:
            codec.payload_from_proto(message, views)
        assert err.value.reason == "malformed"


def test_recursive_types_are_walked_to_protobufs_depth_limit() -> None:
    # No hetfed message is recursive; the walk is checked on one that is (Value -> ListValue -> Value), built
    # by hand since protobuf refuses to build what it would refuse to parse.
    def field(number: int, value: bytes) -> bytes:
        return framing.tag(number, framing.WIRE_LEN) + framing.write_varint(len(value)) + value

    def nested(steps: int) -> bytes:  # a Value inside ``steps`` (ListValue, Value) pairs: 2 * steps deep
        v = field(3, b"leaf")
        for _ in range(steps):
            v = field(6, field(1, v) + field(1, field(3, b"x")))
        return v

    value, string = struct_pb2.Value.DESCRIPTOR, struct_pb2.Value.DESCRIPTOR.fields_by_name["string_value"].number
    assert framing.MAX_DEPTH == 100
    for steps in (1, 20, 50):  # 50: the innermost Value 100 messages deep, as deep as protobuf parses
        raw = nested(steps)
        _, lifted = framing.lift(memoryview(raw), value, value, string)
        assert [bytes(v) for v in lifted] == [b"leaf"] + [b"x"] * steps
        same(lifted_parse(struct_pb2.Value, raw, value, string), struct_pb2.Value.FromString(raw))
    with pytest.raises(ValueError, match="nested more than 100 deep"):
        framing.lift(memoryview(nested(51)), value, value, string)
    with pytest.raises(DecodeError):
        struct_pb2.Value.FromString(nested(51))


# ---------------------------------------------------------------------- the same verdict on broken bytes


def test_every_truncation_gets_protobufs_verdict() -> None:
    raw = update_bytes(ModelWeights({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2)}, 9),
                       EvalMetrics(0.5, 10, 0.9, 0.1, 20, {"f1": 0.8}))
    verdicts = set()
    for n in range(len(raw)):
        expected, got = protobuf_parse(apb.Update, raw[:n]), lifted_or_none(apb.Update, raw[:n])
        assert (expected is None) == (got is None), n
        if expected is not None and got is not None:
            same(got, expected)
        verdicts.add(expected is None)
    assert verdicts == {True, False}  # both verdicts occur


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_corrupted_bytes_get_protobufs_verdict_and_meaning(data: st.DataObject) -> None:
    raw = bytearray(update_bytes(HeadWeights(np.ones((2, 3), np.float32), np.zeros(2, np.float32), 4),
                                 EvalMetrics(0.5, 10, 0.9, 0.1, 20)))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    expected, got = protobuf_parse(apb.Update, bytes(raw)), lifted_or_none(apb.Update, bytes(raw))
    assert (expected is None) == (got is None)
    if expected is not None and got is not None:
        same(got, expected)


def test_a_malformed_update_or_instructions_is_a_malformed_rejection() -> None:
    raw = update_bytes(HeadWeights(np.ones((2, 3), np.float32), np.zeros(2, np.float32), 4))
    with pytest.raises(WireError, match=r"the update is not a valid hetfed\.v1\.Update") as err:
        ParsedUpdate(raw[:-3])
    assert err.value.reason == "malformed"
    ins = bytes(encode_instructions(Instructions("run-1", 2, Action.TRAIN, 10, 7, "org-1", [])).data)
    with pytest.raises(WireError, match=r"instructions are not a valid hetfed\.v1\.Instructions") as err:
        decode_instructions(ins + b"\x0a\x05ab", None)
    assert err.value.reason == "malformed"


# ---------------------------------------------------------------------- one copy of an update, not three


def test_a_checked_update_decodes_to_read_only_views_of_the_received_buffer() -> None:
    spec = get_spec("fedavg")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = update_bytes(ModelWeights({"w": w, "b": np.ones(4, np.float32)}, 7), EvalMetrics(0.5, 10, 0.9, 0.1, 20))
    view = np.frombuffer(raw, np.uint8).copy().data.toreadonly()  # as the reassembler hands it over
    buffer = np.frombuffer(view, np.uint8)
    update = ParsedUpdate(view)
    weights = update.check(spec, Phase.TRAIN, {}, 1 << 20, "run-1", 3, "org-é").get(ModelWeights)
    assert weights.num_examples == 7
    assert_same({"w": w, "b": np.ones(4, np.float32)}, weights.tensors)
    for array in weights.tensors.values():
        assert np.shares_memory(array, buffer)  # no copy of the tensor data was made
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0
    update.release()
    del view, buffer, update
    gc.collect()
    assert weights.tensors["w"][2, 3] == 11.0  # the arrays keep the bytes they view alive


def test_decoded_instructions_view_the_pulled_bytes() -> None:
    head = HeadWeights(np.full((2, 3), 0.5, np.float32), np.zeros(2, np.float32), 4)
    raw = bytes(encode_instructions(Instructions("run-1", 2, Action.TRAIN, 10, 7, "org-1", [head])).data)
    ins, traffic = decode_instructions(raw, get_spec("fedavg_head"))
    got = ins.payloads[0]
    assert isinstance(got, HeadWeights)
    assert_same(head, got)
    assert np.shares_memory(got.weight, np.frombuffer(raw, np.uint8))
    assert traffic.kinds["head_weights"].elements == 8


def test_the_received_bytes_are_freed_with_the_last_array_not_at_the_next_garbage_collection() -> None:
    # A parse that made a reference cycle (a recursive closure holding the views, say) would keep every
    # received message alive until the collector ran: a client's memory grew by 17 MB over twelve rounds.
    raw = update_bytes(ModelWeights({"w": np.ones((3, 4), np.float32)}, 7), EvalMetrics(0.5, 10, 0.9, 0.1, 20))
    ins_raw = bytes(encode_instructions(Instructions("run-1", 2, Action.TRAIN, 10, 7, "", [
        ModelWeights({"w": np.ones((3, 4), np.float32)}, 7)])).data)
    gc.collect()
    gc.disable()
    try:
        buffer = np.frombuffer(raw, np.uint8).copy()
        alive = weakref.ref(buffer)
        received = ParsedUpdate(buffer.data.toreadonly()).check(get_spec("fedavg"), Phase.TRAIN, {}, 1 << 20,
                                                                "run-1", 3, "org-é")
        del buffer
        assert alive() is not None  # the decoded arrays view it
        del received
        assert alive() is None

        buffer = np.frombuffer(ins_raw, np.uint8).copy()
        alive = weakref.ref(buffer)
        ins, _ = decode_instructions(buffer.data.toreadonly(), get_spec("fedavg"))
        del buffer
        assert alive() is not None
        del ins
        assert alive() is None
    finally:
        gc.enable()


_RNG = np.random.default_rng(3)
CONCRETE = [
    ModelWeights({"enc.w": _RNG.standard_normal((7, 5)).astype(np.float32), "scalar": np.array(2.5, np.float32),
                  "empty": np.zeros((0, 3), np.float32), "steps": np.arange(4, dtype=np.int64),
                  "f64": _RNG.standard_normal(6)}, 12),
    HeadWeights(_RNG.standard_normal((3, 4)).astype(np.float32), np.zeros(3, np.float32), 5),
    ClassCounts(np.array([0, 4, 9], np.int64)),
    FactorizedWeights((FactorizedLayer("l0", np.ones(2, np.float32), np.arange(3, dtype=np.float32),
                                       np.array([1, 4], np.int64), np.array([0.5, -1.0], np.float32), (2, 3)),), 3),
    EvalMetrics(train_loss=0.25, num_train_examples=3),
]


@pytest.mark.parametrize("wire_dtype", [None, "float16", "bfloat16"])
def test_instructions_lowered_from_placeholders_are_protobufs_bytes(wire_dtype: str | None) -> None:
    """encode_instructions writes the tensors' data once, into the serialized message (``framing.lower``):
    byte for byte what protobuf serializes for the message holding the data, for every payload kind."""
    payloads = CONCRETE
    ins = Instructions("run-1", 3, Action.TRAIN, 10, 7, "", payloads)
    reference = apb.Instructions(envelope=apb.Envelope(run_id="run-1", round=3), action=_ACTION_TO_PROTO[Action.TRAIN],
                                 round_seed=7, total_rounds=10)
    for p in payloads:
        codec.fill_payload(reference.payloads.add(), p, wire_dtype)
        reference.envelope.payload_kinds.append(p.kind.proto_enum)  # type: ignore[arg-type]
    assert bytes(encode_instructions(ins, wire_dtype).data) == reference.SerializeToString()
    big = ModelWeights({"w": np.arange(300_000, dtype=np.float32), "b": np.ones(3, np.float32)}, 2)
    data = encode_instructions(Instructions("run-1", 3, Action.TRAIN, 10, 7, "", [big])).data
    assert bytes(data) == apb.Instructions(
        envelope=apb.Envelope(run_id="run-1", round=3, payload_kinds=[big.kind.proto_enum]),
        action=_ACTION_TO_PROTO[Action.TRAIN], round_seed=7, total_rounds=10,
        payloads=[codec.payload_to_proto(big)]).SerializeToString()

