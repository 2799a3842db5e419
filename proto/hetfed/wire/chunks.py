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
    view = memoryview(data)
    count = max(1, -(-len(data) // chunk_bytes))
    digest = hashlib.sha256(view).digest()
    for i in range(count):
        piece = view[i * chunk_bytes : (i + 1) * chunk_bytes]
        yield apb.Chunk(
            index=i,
            count=count,
            total_bytes=len(data),
            data=bytes(piece),
            sha256=digest if i == count - 1 else b"",
        )


class Reassembler:
    """Collects chunks in order into one buffer; rejects gaps, oversize and checksum mismatches."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buf: bytearray | None = None
        self._next = 0
        self._count = 0
        self._total = 0
        self.sha256 = b""

    def add(self, chunk: apb.Chunk) -> bool:
        """Add the next chunk; returns True once the message is complete and verified."""
        if self._buf is None:
            if chunk.count < 1 or chunk.total_bytes < 0:
                raise WireError("malformed", f"chunk header count={chunk.count} total_bytes={chunk.total_bytes}")
            if chunk.total_bytes > self.max_bytes:
                raise WireError(
                    "oversized", f"message of {chunk.total_bytes} bytes exceeds the limit of {self.max_bytes} bytes"
                )
            self._count = chunk.count
            self._total = chunk.total_bytes
            self._buf = bytearray()
        if chunk.index != self._next or chunk.count != self._count or chunk.total_bytes != self._total:
            raise WireError(
                "malformed",
                f"chunk {chunk.index}/{chunk.count} out of order (expected {self._next}/{self._count})",
            )
        if len(self._buf) + len(chunk.data) > self._total:
            raise WireError("malformed", f"chunks carry more than the announced {self._total} bytes")
        self._buf += chunk.data
        self._next += 1
        if self._next < self._count:
            return False
        if len(self._buf) != self._total:
            raise WireError("malformed", f"chunks carry {len(self._buf)} of the announced {self._total} bytes")
        digest = hashlib.sha256(self._buf).digest()
        if digest != chunk.sha256:
            raise WireError("checksum_mismatch", "SHA-256 of the reassembled message does not match the last chunk")
        self.sha256 = digest
        return True

    @property
    def complete(self) -> bool:
        """Whether every announced chunk has arrived and been verified."""
        return self._buf is not None and self._next == self._count and bool(self.sha256)

    def data(self) -> bytes:
        """The reassembled message bytes."""
        if not self.complete or self._buf is None:
            raise WireError("malformed", f"the stream ended after {self._next} of {self._count} chunks")
        return bytes(self._buf)
