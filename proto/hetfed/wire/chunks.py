"""Splitting serialized messages into checksummed chunks and reassembling them with size limits."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire.errors import WireError

DEFAULT_CHUNK_BYTES = 1 << 20


def split(data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[apb.Chunk]:
    """Chunks 0..n-1 of ``data``; the last carries the SHA-256 of the whole."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(data).cast("B")
    total = view.nbytes
    count = max(1, -(-total // chunk_bytes))
    digest = hashlib.sha256(view).digest()
    whole = data if isinstance(data, bytes) else None
    for i in range(count):
        lo, hi = i * chunk_bytes, min(total, (i + 1) * chunk_bytes)
        # Slicing bytes copies once (not at all for a single chunk); other buffers go through bytes().
        piece = whole[lo:hi] if whole is not None else bytes(view[lo:hi])
        yield apb.Chunk(
            index=i,
            count=count,
            total_bytes=total,
            data=piece,
            sha256=digest if i == count - 1 else b"",
        )


class Reassembler:
    """Collects chunks in order; rejects gaps, extra chunks, oversize and checksum mismatches.

    The chunks' bytes are hashed as they arrive and joined once, when the last chunk has been
    verified: one copy from the chunks into the message, and ``data()`` returns it without another.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: list[bytes] | None = None
        self._received = 0
        self._hash = hashlib.sha256()
        self._data: bytes | None = None
        self._next = 0
        self._count = 0
        self._total = 0
        self.sha256 = b""

    def add(self, chunk: apb.Chunk) -> bool:
        """Add the next chunk; returns True once the message is complete and verified."""
        if self._parts is None:
            if self._data is not None:
                raise WireError("malformed", f"a chunk after the last announced chunk ({self._count} chunks)")
            if chunk.count < 1 or chunk.total_bytes < 0 or chunk.count > max(1, chunk.total_bytes):
                raise WireError("malformed", f"chunk header count={chunk.count} total_bytes={chunk.total_bytes}")
            if chunk.total_bytes > self.max_bytes:
                raise WireError(
                    "oversized", f"message of {chunk.total_bytes} bytes exceeds the limit of {self.max_bytes} bytes"
                )
            self._count = chunk.count
            self._total = chunk.total_bytes
            self._parts = []
        if chunk.index != self._next or chunk.count != self._count or chunk.total_bytes != self._total:
            raise WireError(
                "malformed",
                f"chunk {chunk.index}/{chunk.count} out of order (expected {self._next}/{self._count})",
            )
        data = chunk.data  # read once: every read of a bytes field copies it
        if self._received + len(data) > self._total:
            raise WireError("malformed", f"chunks carry more than the announced {self._total} bytes")
        self._parts.append(data)
        self._hash.update(data)
        self._received += len(data)
        self._next += 1
        if self._next < self._count:
            return False
        if self._received != self._total:
            raise WireError("malformed", f"chunks carry {self._received} of the announced {self._total} bytes")
        digest = self._hash.digest()
        if digest != chunk.sha256:
            raise WireError("checksum_mismatch", "SHA-256 of the reassembled message does not match the last chunk")
        self.sha256 = digest
        parts, self._parts = self._parts, None
        self._data = parts[0] if len(parts) == 1 else b"".join(parts)
        return True

    @property
    def complete(self) -> bool:
        """Whether every announced chunk has arrived and been verified."""
        return self._data is not None

    def data(self) -> bytes:
        """The reassembled message bytes."""
        if self._data is None:
            raise WireError("malformed", f"the stream ended after {self._next} of {self._count} chunks")
        return self._data
