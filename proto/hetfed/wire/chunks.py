"""Splitting serialized messages into checksummed chunks and reassembling them with size limits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, TypeAlias, overload

import numpy as np

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import digest as content
from hetfed.wire import framing
from hetfed.wire.errors import WireError
from hetfed.wire.serialize import Scattered

DEFAULT_CHUNK_BYTES = 1 << 20
# An update's first chunk: the aggregator reads it before admitting the push (it names the run, round and
# size), so a push waiting for a reassembly slot holds no more than this of the update.
FIRST_PUSH_CHUNK_BYTES = 16 << 10

# A whole message's bytes: a reassembled one is a read-only view of the reassembler's buffer.
Bytes: TypeAlias = bytes | memoryview


def _plan(data: Bytes | bytearray | Scattered, chunk_bytes: int, first_bytes: int | None,
          ) -> tuple[memoryview | Scattered, list[int], bytes]:
    """``data`` as a byte view, its chunk boundaries (0, ..., total: one chunk, maybe empty, at least) and the
    digest of the whole (``hetfed.wire.digest``)."""
    if chunk_bytes <= 0 or (first_bytes is not None and first_bytes <= 0):
        raise ValueError("chunk sizes must be positive")
    view = data if isinstance(data, Scattered) else memoryview(data).cast("B")
    total = view.nbytes
    first = chunk_bytes if first_bytes is None else min(first_bytes, chunk_bytes)
    bounds = [0, *range(first, total, chunk_bytes), total] if total > first else [0, total]
    return view, bounds, view.digest() if isinstance(view, Scattered) else content.digest(view)


def split(data: Bytes | bytearray, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
          first_bytes: int | None = None) -> Iterator[apb.Chunk]:
    """Chunks 0..n-1 of ``data``; the last carries the BLAKE3 digest of the whole.

    ``first_bytes`` makes the first chunk at most that long (the rest ``chunk_bytes`` each): a receiver that
    reads the first message before it admits the stream then holds little of a stream it makes wait.
    """
    view, bounds, digest = _plan(data, chunk_bytes, first_bytes)
    total, count = view.nbytes, len(bounds) - 1
    whole = data if isinstance(data, bytes) else None
    for i in range(count):
        lo, hi = bounds[i], bounds[i + 1]
        # Slicing bytes copies once (not at all for a single chunk); other buffers go through bytes().
        piece = whole[lo:hi] if whole is not None else bytes(view[lo:hi])
        yield apb.Chunk(
            index=i,
            count=count,
            total_bytes=total,
            data=piece,
            blake3=digest if i == count - 1 else b"",
        )


# The chunked messages' ``Chunk`` field (the last field of each, so appending it keeps protobuf's field
# order) and the chunk's own fields, as in hetfed/v1/aggregator.proto; tests pin them to the descriptors.
PUSH_CHUNK_FIELD = apb.PushUpdateRequest.CHUNK_FIELD_NUMBER
PULL_CHUNK_FIELD = apb.PullInstructionsResponse.CHUNK_FIELD_NUMBER
_DATA = apb.Chunk.DATA_FIELD_NUMBER
_DATA_TAG = framing.tag(_DATA, framing.WIRE_LEN)
_DIGEST_TAG = framing.tag(apb.Chunk.BLAKE3_FIELD_NUMBER, framing.WIRE_LEN)


class Framed(Sequence[bytes]):
    """The serialized messages that carry ``data`` in chunks (``framed``), each built only when asked for.

    Iterating (a gRPC request stream) holds one framed message at a time, not the whole update framed again;
    iterating once more (a retry) frames the same bytes again from ``data``, which it keeps (a view, no copy).
    """

    def __init__(self, envelope: bytes, chunk_field: int, data: Bytes | bytearray | Scattered, chunk_bytes: int,
                 first_bytes: int | None) -> None:
        self._view, self._bounds, self._digest = _plan(data, chunk_bytes, first_bytes)
        self._envelope = envelope
        self._chunk_tag = framing.tag(chunk_field, framing.WIRE_LEN)
        self._count = len(self._bounds) - 1
        self._heads = [self._head(i) for i in range(self._count)]  # a few dozen bytes per chunk
        self.total_bytes = sum(len(envelope) + len(head) + (self._bounds[i + 1] - self._bounds[i]) + len(tail)
                               for i, (head, tail) in enumerate(self._heads))
        """Bytes of all the messages together (what the stream puts on the wire), without building them."""

    def _head(self, i: int) -> tuple[bytes, bytes]:
        """Message ``i``'s bytes before its chunk's data (after the envelope) and after it."""
        lo, hi = self._bounds[i], self._bounds[i + 1]
        head = apb.Chunk(index=i, count=self._count, total_bytes=self._view.nbytes).SerializeToString()
        data_head = _DATA_TAG + framing.write_varint(hi - lo) if hi > lo else b""  # proto3 omits empty bytes
        tail = _DIGEST_TAG + framing.write_varint(len(self._digest)) + self._digest if i == self._count - 1 else b""
        size = len(head) + len(data_head) + (hi - lo) + len(tail)
        return self._chunk_tag + framing.write_varint(size) + head + data_head, tail

    def __len__(self) -> int:
        return self._count

    @property
    def digest(self) -> bytes:
        """The BLAKE3 digest of the whole ``data`` (what the last message carries)."""
        return self._digest

    @property
    def data_bytes(self) -> int:
        """The length of the whole ``data`` (what every chunk announces as its total)."""
        return self._bounds[-1]

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"message {i} of {self._count}")
        head, tail = self._heads[i]
        return b"".join((self._envelope, head, self._view[self._bounds[i]:self._bounds[i + 1]], tail))

    def __iter__(self) -> Iterator[bytes]:
        for i in range(self._count):
            yield self[i]


def framed(envelope: bytes, chunk_field: int, data: Bytes | bytearray | Scattered, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           first_bytes: int | None = None) -> Framed:
    """The serialized messages that carry ``data`` in chunks: each is ``envelope`` (a serialized message
    without its chunk) with field ``chunk_field`` set to the next ``split`` chunk.

    The same bytes protobuf would produce for ``Message(..., chunk=c).SerializeToString()`` (the chunk is the
    message's last field), with each byte of ``data`` hashed once (here) and copied once, into its message,
    when that message is asked for (``Framed``: a lazy sequence).
    """
    return Framed(envelope, chunk_field, data, chunk_bytes, first_bytes)


def unframed(raw: bytes, chunk_field: int) -> tuple[bytes, memoryview | None]:
    """``raw`` without its chunk's data, and that data as a view of ``raw`` (no copy).

    When the message does not have exactly one chunk field holding exactly one data field (a sender other
    than hetfed's may merge several; protobuf's parser gives them their meaning), or when ``raw`` is not
    well-formed, returns ``(raw, None)``: the caller parses it whole and reads the data from the message.
    """
    view = memoryview(raw)
    try:
        chunks_found = [f for f in framing.fields(view) if f[0] == chunk_field]
        if len(chunks_found) != 1 or chunks_found[0][1] != framing.WIRE_LEN:
            return raw, None
        _, _, key_at, start, end = chunks_found[0]
        datas = [f for f in framing.fields(view, start, end) if f[0] == _DATA]
    except ValueError:
        return raw, None
    if len(datas) != 1 or datas[0][1] != framing.WIRE_LEN:
        return raw, None
    _, _, data_key_at, data_start, data_end = datas[0]
    rest = (end - start) - (data_end - data_key_at)
    head = framing.tag(chunk_field, framing.WIRE_LEN) + framing.write_varint(rest)
    small = b"".join((view[:key_at], head, view[start:data_key_at], view[data_end:]))
    return small, view[data_start:data_end]


class Sink(Protocol):
    """Where a reassembler puts a message's bytes as they arrive: memory, or a file (the aggregator's spool)."""

    def allocate(self, total: int) -> None:
        """Make room for a message of ``total`` bytes (called once, before the first write)."""
        ...

    def write(self, offset: int, data: Bytes) -> None:
        """Store ``data`` at ``offset``."""
        ...

    def view(self) -> memoryview:
        """The whole message, read-only (called once, when it is complete and verified)."""
        ...


class MemorySink:
    """One buffer of the announced size, allocated uninitialised: its pages become memory only as chunks fill
    them, so a sender announcing more than it sends costs what it sent."""

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None

    def allocate(self, total: int) -> None:
        self._buffer = np.empty(total, np.uint8)

    def write(self, offset: int, data: Bytes) -> None:
        assert self._buffer is not None
        self._buffer[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def view(self) -> memoryview:
        buffer, self._buffer = self._buffer, None
        assert buffer is not None
        return buffer.data.toreadonly()

    def prefix(self, n: int) -> memoryview:
        """The first ``n`` bytes written (a view of the buffer)."""
        assert self._buffer is not None
        return self._buffer[:n].data


class Reassembler:
    """Collects chunks in order; rejects gaps, extra chunks, oversize and checksum mismatches.

    Each chunk's bytes are hashed and written, as they arrive, into a ``Sink`` of the announced size (one
    memory buffer unless another is given): the message is never held twice (chunks and joined copy). The
    hash state lives here, so a reassembler fed by one stream can be fed the rest by another (a resumed push).
    """

    def __init__(self, max_bytes: int, sink: Sink | None = None) -> None:
        self.max_bytes = max_bytes
        self._sink: Sink | None = sink or MemorySink()
        self._allocated = False
        self._received = 0
        self._hash = content.hasher()
        self._data: memoryview | None = None
        self._done = False
        self._next = 0
        self._count = 0
        self._total = 0
        self.digest = b""  # the verified message's BLAKE3 digest, once complete

    @property
    def next_index(self) -> int:
        """The index of the next chunk expected (the number of chunks held)."""
        return self._next

    @property
    def received(self) -> int:
        """The message bytes held so far."""
        return self._received

    @property
    def shape(self) -> tuple[int, int]:
        """(chunk count, total bytes) as the first chunk announced them; (0, 0) before it."""
        return self._count, self._total

    def prefix_digest(self) -> bytes:
        """The BLAKE3 digest of the bytes received so far (the hash state goes on)."""
        return self._hash.digest()

    def restore(self, shape: tuple[int, int], held: tuple[int, int], hash_state: content.Hasher) -> None:
        """Go on with a reassembly begun elsewhere (an earlier process): ``shape`` (chunk count, total bytes) as
        its first chunk announced them, ``held`` (chunks, bytes) already in the sink, which is opened on them
        (its ``allocate`` is not called), and ``hash_state``, the hash of those bytes."""
        (count, total), (index, received) = shape, held
        if self._allocated or self._done:
            raise ValueError("only a reassembly that has not started is restored")
        if not (0 < index < count <= max(1, total) and 0 <= received <= total <= self.max_bytes):
            raise ValueError(f"{index} of {count} chunks, {received} of {total} bytes: not a partial message")
        self._count, self._total, self._next, self._received = count, total, index, received
        self._hash = hash_state
        self._allocated = True

    def move_to(self, sink: Sink) -> None:
        """Go on in ``sink`` instead of the memory buffer, the bytes received so far copied there."""
        if not isinstance(self._sink, MemorySink) or not self._allocated:
            raise ValueError("only a started reassembly in memory moves")
        sink.allocate(self._total)
        sink.write(0, self._sink.prefix(self._received))
        self._sink = sink

    def add(self, chunk: apb.Chunk, data: Bytes | None = None) -> bool:
        """Add the next chunk (``data``: its bytes, when read apart from the message with ``unframed``);
        returns True once the message is complete and verified."""
        if not self._allocated:
            if self._done:
                raise WireError("malformed", f"a chunk after the last announced chunk ({self._count} chunks)")
            if chunk.count < 1 or chunk.total_bytes < 0 or chunk.count > max(1, chunk.total_bytes):
                raise WireError("malformed", f"chunk header count={chunk.count} total_bytes={chunk.total_bytes}")
            if chunk.total_bytes > self.max_bytes:
                raise WireError(
                    "oversized", f"message of {chunk.total_bytes} bytes exceeds the limit of {self.max_bytes} bytes"
                )
            self._count = chunk.count
            self._total = chunk.total_bytes
            assert self._sink is not None
            self._sink.allocate(self._total)
            self._allocated = True
        if chunk.index != self._next or chunk.count != self._count or chunk.total_bytes != self._total:
            raise WireError(
                "malformed",
                f"chunk {chunk.index}/{chunk.count} out of order (expected {self._next}/{self._count})",
            )
        if data is None:
            data = chunk.data  # read once: every read of a bytes field copies it
        elif chunk.data:
            raise ValueError("a chunk's data given twice")
        end = self._received + len(data)
        if end > self._total:
            raise WireError("malformed", f"chunks carry more than the announced {self._total} bytes")
        self._hash.update(data)
        assert self._sink is not None
        self._sink.write(self._received, data)
        self._received = end
        self._next += 1
        if self._next < self._count:
            return False
        if self._received != self._total:
            raise WireError("malformed", f"chunks carry {self._received} of the announced {self._total} bytes")
        digest = self._hash.digest()
        if digest != chunk.blake3:
            if chunk.sha256 and not chunk.blake3:  # the field an older hetfed sent
                raise WireError("checksum_mismatch", "the last chunk carries a SHA-256 (Chunk field 5) and no BLAKE3 "
                                "digest (field 6): the sender runs a hetfed from before BLAKE3 replaced SHA-256 on "
                                "the wire; upgrade it to this version")
            raise WireError("checksum_mismatch", "BLAKE3 digest of the reassembled message does not match the last chunk")
        self.digest = digest
        sink, self._sink = self._sink, None
        self._data = sink.view()
        self._allocated = False
        self._done = True
        return True

    @property
    def complete(self) -> bool:
        """Whether every announced chunk has arrived and been verified."""
        return self._done

    def data(self) -> memoryview:
        """The reassembled message bytes (a read-only view of the buffer)."""
        if self._data is None:
            if self._done:
                raise ValueError("the message was taken")
            raise WireError("incomplete", f"the stream ended after {self._next} of {self._count} chunks")
        return self._data

    def take(self) -> memoryview:
        """The reassembled message bytes, which the reassembler then no longer holds."""
        data, self._data = self.data(), None
        return data
