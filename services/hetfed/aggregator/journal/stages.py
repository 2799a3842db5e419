"""The stage log (``secure.log``): the open round's secure-aggregation stages, durable before they are answered.

A secure round's coordinator (``hetfed.aggregator.run.secure.SecureRound``) is a deterministic function of the
stage messages it took and of its closes, so the log holds them, in order, for the open round only:

- ``OPEN``: the round's roster (JSON), written first; a new round's ``OPEN`` replaces the whole log.
- ``MESSAGE``: an organization's stage message of stage 1, 2 or 4, as it arrived (the serialized payload), written
  before the coordinator takes it. One it then refuses is refused again by a replay.
- ``CLOSE``: the close of stage 1, 2 or 3, with the SHA-256 of what it gives each organization; written before any
  of it is given out, so a replay that would give something else is detected.
- ``ABANDON``: why the round's aggregate was abandoned outside the protocol (a restart that could not resume it).

The masked inputs (stage 3) are not here: they ride on PushUpdate and are in the update log (``updates.wal``).

Each record is a header (magic, round, kind, lengths), the organization, the data, and a BLAKE2b-128 digest of
all of them; each append is fsync'd before the caller is answered. At start-up, a record cut short at the end (an
interrupted append, never answered) is cut off; a record that fails its digest before the end marks the log
``damaged`` and nothing past it is read.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.aggregator.journal.disk import Disk, StateError, StorageError

log = logging.getLogger("hetfed.aggregator")

_MAGIC = b"HFS1"
_HEAD = struct.Struct("<4sqBHI")  # magic, round, kind, organization length, data length
_DIGEST = 16


class StageKind(enum.IntEnum):
    """What a record of the stage log holds (module docstring)."""

    OPEN = 1
    MESSAGE = 2
    CLOSE = 3
    ABANDON = 4


@dataclass(frozen=True)
class StageRecord:
    """One record: its round, kind, organization ("" for an open, close or abandon) and data."""

    round: int
    kind: StageKind
    organization: str
    data: bytes


@dataclass
class StageScan:
    """What a read of the log found: its good records, where they end, and whether damage stopped the read."""

    records: list[StageRecord]
    end: int
    damaged: str = ""  # why the read stopped before the end ("" when it did not)
    tail: str = ""  # a record cut short at the end


def _record(round_: int, kind: StageKind, organization: str, data: bytes) -> bytes:
    org = organization.encode()
    body = _HEAD.pack(_MAGIC, round_, int(kind), len(org), len(data)) + org + data
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def scan_stages(blob: bytes) -> StageScan:
    """Every good record of a stage log's bytes (module docstring)."""
    out = StageScan([], 0)
    pos = 0
    while pos < len(blob):
        if pos + _HEAD.size > len(blob):
            out.tail = f"{len(blob) - pos} bytes at offset {pos} hold no complete record"
            break
        magic, round_, kind, org_len, data_len = _HEAD.unpack_from(blob, pos)
        stop = pos + _HEAD.size + org_len + data_len + _DIGEST
        if magic != _MAGIC or kind not in StageKind._value2member_map_:
            out.damaged = f"no valid record at offset {pos}"
            break
        if stop > len(blob):
            out.tail = f"the record at offset {pos} is cut short"
            break
        body = blob[pos:stop - _DIGEST]
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != blob[stop - _DIGEST:stop]:
            if stop == len(blob):
                out.tail = f"the last record, at offset {pos}, fails its digest"
            else:
                out.damaged = f"the record at offset {pos} fails its digest"
            break
        org = body[_HEAD.size:_HEAD.size + org_len].decode(errors="replace")
        out.records.append(StageRecord(round_, StageKind(kind), org, bytes(body[_HEAD.size + org_len:])))
        pos = out.end = stop
    return out


class StageLog:
    """The run's stage log; ``open()`` once, then ``start`` a round and ``append`` to it (module docstring)."""

    def __init__(self, path: Path, disk: Disk) -> None:
        self.path, self.disk = path, disk
        self._fd = -1
        self._size = 0
        self.scan = StageScan([], 0)  # what ``open`` read back

    def open(self) -> None:
        """Read the log back, cutting off a record cut short at its end; StateError when it cannot be opened."""
        blob = self.path.read_bytes() if self.path.exists() else b""
        self.scan = scan_stages(blob)
        if self.scan.damaged:
            log.error("%s: %s; the secure round it records cannot be resumed", self.path, self.scan.damaged)
        if not blob:
            return  # created by a secure round's first record only
        try:
            self._fd = self.disk.open(self.path)
            if self.scan.tail and not self.scan.damaged:
                log.warning("%s: %s (an append interrupted by a crash): cut off", self.path, self.scan.tail)
                self.disk.truncate(self._fd, self.scan.end)
                self.disk.fsync(self._fd)
        except OSError as exc:
            raise StateError(f"{self.path} cannot be opened ({exc})") from None
        self._size = len(blob) if self.scan.damaged else self.scan.end

    def records(self, round_: int) -> tuple[list[StageRecord], str]:
        """The records of ``round_`` read back at start-up, and why the log was damaged ("" when it was not)."""
        return [r for r in self.scan.records if r.round == round_], self.scan.damaged

    def start(self, round_: int, roster: bytes) -> None:
        """Replace the log by a round's ``OPEN`` record, durably; StorageError on failure."""
        self._write(_record(round_, StageKind.OPEN, "", roster), 0)

    def append(self, round_: int, kind: StageKind, organization: str, data: bytes) -> None:
        """Append one record durably (before its caller is answered); StorageError on failure (the log is cut
        back to where it was, when it can be)."""
        self._write(_record(round_, kind, organization, data), self._size)
        crash_point("stages.appended")

    def _write(self, record: bytes, at: int) -> None:
        try:
            if self._fd < 0:
                self._fd = self.disk.open(self.path)
            if at == 0:
                self.disk.truncate(self._fd, 0)
                self._size = 0
            self.disk.pwrite(self._fd, record, at)
            self.disk.fsync(self._fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.disk.truncate(self._fd, self._size)
            raise StorageError(f"could not write {self.path} ({exc.strerror or exc})") from None
        self._size = at + len(record)

    def close(self) -> None:
        """Close the log's file."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self.disk.close(self._fd)
        self._fd = -1
