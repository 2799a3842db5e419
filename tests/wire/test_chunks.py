"""Tests for hetfed.wire.chunks: split/reassemble around chunk boundaries and every way a stream can be wrong."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks
from hetfed.wire.errors import WireError

C = 1000  # chunk size of these tests


def payload(n: int) -> bytes:
    """``n`` deterministic, non-repeating-looking bytes."""
    return bytes((i * 131 + (i >> 8) * 7) & 0xFF for i in range(n))


def reassemble(parts: list[apb.Chunk], max_bytes: int = 1 << 30) -> bytes:
    asm = chunks.Reassembler(max_bytes)
    done = [asm.add(c) for c in parts]
    assert done == [False] * (len(parts) - 1) + [True]
    assert asm.complete
    return asm.data()


def wire_error(parts: list[apb.Chunk], reason: str, max_bytes: int = 1 << 30) -> WireError:
    """Feed ``parts`` and expect WireError(reason) from add() or, if the stream just ends, from data()."""
    asm = chunks.Reassembler(max_bytes)

    def feed() -> None:
        for c in parts:
            asm.add(c)
        asm.data()

    with pytest.raises(WireError) as err:
        feed()
    assert err.value.reason == reason, str(err.value)
    return err.value


@pytest.mark.parametrize(("size", "count"), [
    (0, 1), (1, 1), (C - 1, 1), (C, 1), (C + 1, 2), (2 * C - 1, 2), (2 * C, 2), (3 * C + 7, 4), (5 * C, 5),
])
def test_split_and_reassemble_around_chunk_boundaries(size: int, count: int) -> None:
    data = payload(size)
    parts = list(chunks.split(data, C))
    assert len(parts) == count
    digest = blake3.blake3(data).digest()
    for i, c in enumerate(parts):
        assert (c.index, c.count, c.total_bytes) == (i, count, size)
        assert c.data == data[i * C : (i + 1) * C]
        assert c.blake3 == (digest if i == count - 1 else b"")
        assert c.sha256 == b""  # the field an older hetfed sent
    assert all(len(c.data) == C for c in parts[:-1])
    assert 0 < len(parts[-1].data) <= C or size == 0
    assert b"".join(c.data for c in parts) == data
    # Chunks survive their own serialization (they travel inside PushUpdateRequest/PullInstructionsResponse).
    parts = [apb.Chunk.FromString(c.SerializeToString()) for c in parts]
    assert reassemble(parts) == data


@pytest.mark.parametrize(("size", "sizes"), [
    (0, [0]), (7, [7]), (10, [10]), (11, [10, 1]), (10 + C, [10, C]), (11 + C, [10, C, 1]), (2 * C, [10, C, C - 10]),
])
def test_a_short_first_chunk_then_full_ones(size: int, sizes: list[int]) -> None:
    data = payload(size)
    parts = list(chunks.split(data, C, first_bytes=10))
    assert [len(c.data) for c in parts] == sizes
    assert {(c.count, c.total_bytes) for c in parts} == {(len(sizes), size)}
    assert reassemble(parts) == data
    assert [len(c.data) for c in chunks.split(payload(5), C, first_bytes=C + 1)] == [5]
    with pytest.raises(ValueError, match="positive"):
        next(chunks.split(data, C, first_bytes=0))


def test_reassembler_reports_the_digest_and_returns_the_same_bytes_each_time() -> None:
    data = payload(2500)
    asm = chunks.Reassembler(10_000)
    assert not asm.complete
    for c in chunks.split(data, C):
        asm.add(c)
    assert asm.digest == blake3.blake3(data).digest()
    first = asm.data()
    assert first == data
    assert asm.data() is first  # no second copy
    assert first.readonly
    assert asm.take() is first and asm.complete
    with pytest.raises(ValueError, match="taken"):
        asm.data()  # handed over: the reassembler no longer holds the bytes
    with pytest.raises(WireError, match="after the last announced chunk"):
        asm.add(next(iter(chunks.split(data, C))))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's RSS from /proc")
def test_a_sender_announcing_more_than_it_sends_costs_only_what_it_sent() -> None:
    announced = 2 << 30
    asm = chunks.Reassembler(4 << 30)
    before = _rss_bytes()
    asm.add(apb.Chunk(index=0, count=2048, total_bytes=announced, data=b"x" * (1 << 20)))
    assert _rss_bytes() - before < 64 << 20  # 1 MiB received of 2 GiB announced
    assert not asm.complete


@pytest.mark.parametrize("make", [bytearray, memoryview, lambda b: memoryview(bytearray(b))])
def test_split_accepts_any_bytes_like(make: Callable[[bytes], object]) -> None:
    data = payload(2 * C + 3)
    parts = list(chunks.split(make(data), C))  # type: ignore[arg-type]
    assert [len(c.data) for c in parts] == [C, C, 3]
    assert reassemble(parts) == data


def test_default_chunk_size_is_one_mebibyte() -> None:
    assert chunks.DEFAULT_CHUNK_BYTES == 1 << 20
    parts = list(chunks.split(bytes((1 << 20) + 1)))
    assert [len(c.data) for c in parts] == [1 << 20, 1]


@pytest.mark.parametrize("bad", [0, -1])
def test_chunk_size_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        list(chunks.split(b"abc", bad))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), chunk_bytes=st.integers(min_value=1, max_value=700))
def test_any_size_and_chunk_size_round_trip(data: bytes, chunk_bytes: int) -> None:
    parts = list(chunks.split(data, chunk_bytes))
    assert len(parts) == max(1, -(-len(data) // chunk_bytes))
    assert reassemble(parts, max_bytes=len(data)) == data


# ---------------------------------------------------------------- broken streams


@pytest.fixture
def parts() -> list[apb.Chunk]:
    return list(chunks.split(payload(4 * C + 10), C))  # 5 chunks


def test_out_of_order_chunks_are_malformed(parts: list[apb.Chunk]) -> None:
    err = wire_error([parts[1], parts[0], *parts[2:]], "malformed")
    assert "out of order" in err.message
    wire_error([parts[0], parts[2], parts[1], *parts[3:]], "malformed")
    wire_error(list(reversed(parts)), "malformed")


def test_missing_chunks_are_malformed_and_a_stream_ending_early_incomplete(parts: list[apb.Chunk]) -> None:
    wire_error([p for i, p in enumerate(parts) if i != 2], "malformed")  # gap in the middle
    wire_error(parts[1:], "malformed")  # no first chunk
    err = wire_error(parts[:-1], "incomplete")  # the stream ends early (a cut connection reads so): data() refuses
    assert "ended after 4 of 5 chunks" in err.message
    asm = chunks.Reassembler(1 << 20)
    assert not asm.complete
    with pytest.raises(WireError, match="ended after 0 of 0"):
        asm.data()


def test_extra_and_repeated_chunks_are_malformed(parts: list[apb.Chunk]) -> None:
    wire_error([parts[0], parts[0], *parts[1:]], "malformed")
    err = wire_error([*parts, parts[-1]], "malformed")
    assert "after the last" in err.message
    after = apb.Chunk(index=5, count=5, total_bytes=parts[0].total_bytes, data=b"")
    wire_error([*parts, after], "malformed")
    wire_error([*parts, apb.Chunk(index=0, count=1, total_bytes=0)], "malformed")  # a second message


def test_inconsistent_headers_are_malformed(parts: list[apb.Chunk]) -> None:
    changed_count = apb.Chunk()
    changed_count.CopyFrom(parts[1])
    changed_count.count = 6
    wire_error([parts[0], changed_count, *parts[2:]], "malformed")
    changed_total = apb.Chunk()
    changed_total.CopyFrom(parts[1])
    changed_total.total_bytes += 1
    wire_error([parts[0], changed_total, *parts[2:]], "malformed")


@pytest.mark.parametrize("header", [
    {"count": 0, "total_bytes": 0},
    {"count": 1, "total_bytes": -1},
    {"count": 5, "total_bytes": 3},  # more chunks than bytes: a stream of empty chunks
    {"count": 2, "total_bytes": 0},
])
def test_impossible_first_headers_are_malformed(header: dict[str, int]) -> None:
    err = wire_error([apb.Chunk(index=0, data=b"", **header)], "malformed")
    assert "chunk header" in err.message


def test_more_or_fewer_bytes_than_announced_are_malformed(parts: list[apb.Chunk]) -> None:
    longer = apb.Chunk()
    longer.CopyFrom(parts[-1])
    longer.data += b"x" * (C - len(longer.data) + 1)
    err = wire_error([*parts[:-1], longer], "malformed")
    assert "more than the announced" in err.message
    shorter = apb.Chunk()
    shorter.CopyFrom(parts[-1])
    shorter.data = shorter.data[:-1]
    err = wire_error([*parts[:-1], shorter], "malformed")
    assert f"carry {4 * C + 9} of the announced {4 * C + 10}" in err.message


def test_wrong_checksum_is_a_checksum_mismatch(parts: list[apb.Chunk]) -> None:
    last = apb.Chunk()
    last.CopyFrom(parts[-1])
    last.blake3 = blake3.blake3(b"something else").digest()
    err = wire_error([*parts[:-1], last], "checksum_mismatch")
    assert err.status == "INVALID_ARGUMENT"
    assert "BLAKE3 digest of the reassembled message does not match" in err.message
    unsigned = apb.Chunk()
    unsigned.CopyFrom(parts[-1])
    unsigned.blake3 = b""
    wire_error([*parts[:-1], unsigned], "checksum_mismatch")
    flipped = apb.Chunk()
    flipped.CopyFrom(parts[2])
    flipped.data = bytes([flipped.data[0] ^ 1]) + flipped.data[1:]  # same length, one bit differs
    wire_error([*parts[:2], flipped, *parts[3:]], "checksum_mismatch")


def test_a_sha256_from_an_older_sender_is_refused_by_name(parts: list[apb.Chunk]) -> None:
    # Before BLAKE3, hetfed's last chunk carried the SHA-256 of the message in field 5 and nothing in field 6.
    data = b"".join(c.data for c in parts)
    old = apb.Chunk()
    old.CopyFrom(parts[-1])
    old.blake3 = b""
    old.sha256 = hashlib.sha256(data).digest()
    err = wire_error([*parts[:-1], old], "checksum_mismatch")
    assert "carries a SHA-256 (Chunk field 5) and no BLAKE3 digest (field 6)" in err.message
    assert "upgrade it" in err.message


def test_oversized_total_is_refused_at_the_first_chunk() -> None:
    huge = apb.Chunk(index=0, count=1 << 20, total_bytes=1 << 40, data=b"x")
    asm = chunks.Reassembler(max_bytes=1 << 20)
    with pytest.raises(WireError) as err:
        asm.add(huge)  # refused on the header alone: nothing of the announced terabyte is buffered
    assert err.value.reason == "oversized"
    assert err.value.status == "RESOURCE_EXHAUSTED"
    assert str(1 << 40) in err.value.message
    assert not asm.complete


def test_total_equal_to_the_limit_is_accepted() -> None:
    data = payload(3 * C)
    assert reassemble(list(chunks.split(data, C)), max_bytes=3 * C) == data
    wire_error(list(chunks.split(data, C)), "oversized", max_bytes=3 * C - 1)


def test_a_restored_reassembly_goes_on_from_its_position_and_hash_state() -> None:
    data = bytes(range(256)) * 40
    parts = list(chunks.split(data, 1000, first_bytes=240))
    first = chunks.Reassembler(1 << 20)
    for part in parts[:4]:
        first.add(part)
    assert (first.next_index, first.received) == (4, 3240)
    assert first.prefix_digest() == blake3.blake3(data[:3240]).digest()
    # Another reassembler, whose sink already holds the first 3240 bytes, takes over with the hash state of them.
    sink = chunks.MemorySink()
    sink.allocate(len(data))
    sink.write(0, data[:3240])
    second = chunks.Reassembler(1 << 20, sink)
    second.restore((len(parts), len(data)), (4, 3240), blake3.blake3(data[:3240]))
    for part in parts[4:]:
        second.add(part)
    assert bytes(second.take()) == data and second.digest == blake3.blake3(data).digest()
    for shape, held in (((11, 10240), (0, 0)), ((11, 10240), (11, 10240)), ((11, 10240), (4, 10241)),
                        ((11, 10), (4, 3)), ((11, 1 << 21), (4, 3240))):
        with pytest.raises(ValueError, match="not a partial message"):
            chunks.Reassembler(1 << 20).restore(shape, held, blake3.blake3())
    with pytest.raises(ValueError, match="only a reassembly that has not started is restored"):
        first.restore((len(parts), len(data)), (4, 3240), blake3.blake3())
