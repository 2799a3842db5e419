"""Tests for chunk framing by hand (hetfed.wire.framing, chunks.framed/unframed): protobuf's own bytes and
meaning, with each chunk's data copied once on the way out and not at all on the way in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, framing
from hetfed.wire.errors import WireError
from hetfed.wire.rpc import parse_chunked

C = 1000


def payload(n: int) -> bytes:
    return bytes((i * 131 + (i >> 8) * 7) & 0xFF for i in range(n))


def push_envelope(round_: int = 3) -> apb.PushUpdateRequest:
    return apb.PushUpdateRequest(run_id="run-1", round=round_, organization_id="org-é")


def test_the_chunk_is_the_last_field_of_both_chunked_messages() -> None:
    # framed() appends the chunk to the serialized envelope: protobuf's field order holds only if it is last
    # of the envelope's fields. A push's update digest comes after it: the client appends it to a message.
    after = {"update_blake3"}
    for cls, number in ((apb.PushUpdateRequest, chunks.PUSH_CHUNK_FIELD),
                        (apb.PullInstructionsResponse, chunks.PULL_CHUNK_FIELD)):
        assert max(f.number for f in cls.DESCRIPTOR.fields if f.name not in after) == number
        assert all(f.number > number for f in cls.DESCRIPTOR.fields if f.name in after)
        assert cls.DESCRIPTOR.fields_by_number[number].message_type is apb.Chunk.DESCRIPTOR
    assert [f.name for f in apb.Chunk.DESCRIPTOR.fields] == [
        "index", "count", "total_bytes", "data", "sha256", "blake3"]


@pytest.mark.parametrize("n", [0, 1, C - 1, C, C + 1, 5 * C, 5 * C + 7])
@pytest.mark.parametrize("first", [None, 10, C + 1])
def test_framed_push_is_protobufs_serialization_byte_for_byte(n: int, first: int | None) -> None:
    data = payload(n)
    env = push_envelope()
    expected = [apb.PushUpdateRequest(run_id=env.run_id, round=env.round, organization_id=env.organization_id,
                                      chunk=c).SerializeToString() for c in chunks.split(data, C, first)]
    got = chunks.framed(env.SerializeToString(), chunks.PUSH_CHUNK_FIELD, data, C, first)
    assert list(got) == expected and got.total_bytes == sum(map(len, expected))
    assert [got[i] for i in range(-len(got), len(got))] == expected * 2 and got[1:] == expected[1:]


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=5000), st.integers(1, 3000), st.sampled_from([bytes, bytearray, memoryview]))
def test_framed_pull_responses_are_protobufs_bytes(data: bytes, chunk_bytes: int, kind: type) -> None:
    expected = [apb.PullInstructionsResponse(chunk=c).SerializeToString() for c in chunks.split(data, chunk_bytes)]
    assert list(chunks.framed(b"", chunks.PULL_CHUNK_FIELD, kind(data), chunk_bytes)) == expected


def test_unframed_reads_the_data_as_a_view_of_the_received_bytes() -> None:
    raws = chunks.framed(push_envelope().SerializeToString(), chunks.PUSH_CHUNK_FIELD, payload(3 * C), C)
    asm = chunks.Reassembler(1 << 20)
    for i, raw in enumerate(raws):
        msg, data = parse_chunked(apb.PushUpdateRequest, raw, chunks.PUSH_CHUNK_FIELD)
        whole = apb.PushUpdateRequest.FromString(raw)
        assert data is not None and data.obj is raw  # no copy
        assert bytes(data) == whole.chunk.data
        assert msg.chunk.data == b""
        whole.chunk.data = b""
        assert msg == whole  # everything else exactly as protobuf parses it
        assert asm.add(msg.chunk, data) == (i == len(raws) - 1)
    assert bytes(asm.data()) == payload(3 * C)


def test_unknown_fields_around_the_data_survive_unframing() -> None:
    chunk = apb.Chunk(index=0, count=1, total_bytes=3, data=b"abc").SerializeToString()
    unknown = framing.tag(9, framing.WIRE_VARINT) + framing.write_varint(300)
    chunk = unknown + chunk + framing.tag(11, framing.WIRE_LEN) + b"\x02hi"
    raw = (push_envelope().SerializeToString() + unknown + framing.tag(4, framing.WIRE_LEN)
           + framing.write_varint(len(chunk)) + chunk + framing.tag(12, 5) + b"\x01\x02\x03\x04")
    msg, data = parse_chunked(apb.PushUpdateRequest, raw, chunks.PUSH_CHUNK_FIELD)
    assert data is not None and bytes(data) == b"abc"
    whole = apb.PushUpdateRequest.FromString(raw)
    whole.chunk.data = b""
    assert msg.SerializeToString() == whole.SerializeToString()


def test_what_protobuf_merges_is_left_to_protobuf() -> None:
    env = push_envelope().SerializeToString()
    one = apb.PushUpdateRequest(chunk=apb.Chunk(index=0, count=2, data=b"first")).SerializeToString()
    two = apb.PushUpdateRequest(chunk=apb.Chunk(total_bytes=7, data=b"second")).SerializeToString()
    # Two chunk fields merge (the later data wins, the earlier count stays); two data fields: the last wins.
    merged = env + one + two
    data_twice = framing.tag(4, framing.WIRE_LEN) + b"\x05first" + framing.tag(4, framing.WIRE_LEN) + b"\x05other"
    doubled = env + framing.tag(4, framing.WIRE_LEN) + framing.write_varint(len(data_twice)) + data_twice
    for raw in (merged, doubled):
        assert chunks.unframed(raw, chunks.PUSH_CHUNK_FIELD) == (raw, None)
        msg, data = parse_chunked(apb.PushUpdateRequest, raw, chunks.PUSH_CHUNK_FIELD)
        assert data is None
        assert msg == apb.PushUpdateRequest.FromString(raw)
    assert apb.PushUpdateRequest.FromString(merged).chunk.count == 2
    assert apb.PushUpdateRequest.FromString(merged).chunk.data == b"second"
    assert apb.PushUpdateRequest.FromString(doubled).chunk.data == b"other"


def test_a_data_field_of_another_wire_type_is_left_to_protobuf() -> None:
    chunk = framing.tag(4, framing.WIRE_VARINT) + b"\x07"
    raw = framing.tag(4, framing.WIRE_LEN) + framing.write_varint(len(chunk)) + chunk
    assert chunks.unframed(raw, chunks.PUSH_CHUNK_FIELD) == (raw, None)


@pytest.mark.parametrize("raw", [
    b"\x22\x05abc",  # a chunk longer than the message
    b"\x22\x03\x22\x05a",  # a data field longer than its chunk
    b"\x22",  # a truncated length
    b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an overlong varint
    b"\x07",  # wire type 7
    b"\x00\x01",  # field number 0
])
def test_malformed_bytes_are_a_malformed_rejection(raw: bytes) -> None:
    assert chunks.unframed(raw, chunks.PUSH_CHUNK_FIELD) == (raw, None)
    with pytest.raises(WireError) as err:
        parse_chunked(apb.PushUpdateRequest, raw, chunks.PUSH_CHUNK_FIELD)
    assert err.value.reason == "malformed"


@given(st.integers(0, (1 << 64) - 1))
def test_varints_round_trip(value: int) -> None:
    encoded = framing.write_varint(value)
    assert framing.read_varint(memoryview(encoded), 0) == (value, len(encoded))
    assert apb.Chunk(total_bytes=value if value < 1 << 63 else 0).SerializeToString()[1:] == (
        framing.write_varint(value) if 0 < value < 1 << 63 else b"")


def test_a_chunk_given_its_data_twice_is_a_programming_error() -> None:
    asm = chunks.Reassembler(100)
    with pytest.raises(ValueError, match="twice"):
        asm.add(apb.Chunk(index=0, count=1, total_bytes=3, data=b"abc"), memoryview(b"abc"))
