"""The write-ahead log (``updates.wal``): the open round's accepted updates, durable before acknowledged.

A file header holds a random key; each record is a header (magic, round, lengths, digest of the update, a MAC
keyed by the file's key over the header and the organization) followed by the organization and the update. The
digest is BLAKE3 (record magic ``HFR3``, the wire's digest, so a pushed update is hashed once); records an older
hetfed wrote carry SHA-256 (``HFR2``) and are still read and verified, so an aggregator upgraded mid-round
resumes its log. An
update is appended at the end of the last good record; an append that fails is cut back (truncate, fsync) so the
log is exactly as it was. Appends are written under the run's lock and made durable outside it with group commit
(``append``, then ``sync``): one fsync covers every record written before it started. A failed fsync leaves every
record past the last durable point suspect: each is answered with a retryable status and the log is cut back to
that point before the next append.

At start-up a record cut short at the end (an interrupted append) is cut off. A record whose header verifies but
whose update fails its digest is discarded alone. A record whose header fails its MAC has untrusted lengths: the
log is searched for the next header that verifies, and what lies between is skipped. A damaged file header moves
the log aside. Damage is logged with offsets, round and organization.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import io
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.aggregator.journal.disk import Disk, StateError, StorageError, atomic_write, mapped
from hetfed.wire import digest as content
from hetfed.wire.pages import BLOCK_BYTES, drop_pages

log = logging.getLogger("hetfed.aggregator")

# updates.wal: a file header, then records.
_FILE_MAGIC = b"HFW2"
_FILE_HEADER = struct.Struct("<4s16sI")  # magic, key, CRC-32 of magic and key
_REC_MAGIC = b"HFR3"  # the records written: the update's BLAKE3
_SHA256_REC_MAGIC = b"HFR2"  # records of an older hetfed, read only: the update's SHA-256
# Each record magic's digest: its name (for damage reports) and its function.
_RECORD_DIGESTS = {_REC_MAGIC: ("BLAKE3", content.digest),
                   _SHA256_REC_MAGIC: ("SHA-256", lambda data: hashlib.sha256(data).digest())}
# magic, round, organization length, update length, digest of the update, MAC of the header and organization
_REC = struct.Struct("<4sqHQ32s16s")
_REC_SIGNED = _REC.size - 16  # the header bytes the MAC covers (all but the MAC)


def _mac(key: bytes, signed: bytes | memoryview, organization: bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=16)
    h.update(signed)
    h.update(organization)
    return h.digest()


@dataclass(frozen=True)
class WalTicket:
    """An appended record's place in the log: durable once the log is synced past ``end`` within the same
    ``generation`` (a cut of the log starts a new one, voiding the tickets of the records it removed)."""

    generation: int
    end: int


@dataclass(frozen=True)
class WalRecord:
    """One logged update: where it starts in the log, its round, organization and serialized update."""

    offset: int
    round: int
    organization: str
    data: bytes


@dataclass
class WalScan:
    """What a read of the log found: the good records, where the next append goes, and the damage."""

    records: list[WalRecord] = field(default_factory=list)
    end: int = _FILE_HEADER.size
    problems: list[str] = field(default_factory=list)
    tail: str = ""  # a cut-short record or unreadable bytes at the end (an append interrupted by a crash)


def _header_at(blob: bytes | mmap.mmap, pos: int, key: bytes) -> tuple[int, str, int, bytes, int, bytes] | None:
    """(round, organization, update length, update digest, update offset, record magic) of a verified header at
    ``pos``."""
    if pos + _REC.size > len(blob):
        return None
    magic, round_, org_len, data_len, sha, mac = _REC.unpack_from(blob, pos)
    if magic not in _RECORD_DIGESTS:
        return None
    start = pos + _REC.size + org_len
    if start > len(blob):
        return None
    org = bytes(blob[pos + _REC.size : start])
    if not hmac.compare_digest(_mac(key, blob[pos : pos + _REC_SIGNED], org), mac):
        return None
    return round_, org.decode(errors="replace"), data_len, sha, start, magic


def _next_header(blob: bytes | mmap.mmap, start: int, key: bytes) -> int | None:
    """The offset of the next verified record header (of either magic) at or after ``start``."""
    found = [i for i in (blob.find(m, start) for m in _RECORD_DIGESTS) if i != -1]
    while found:
        i = min(found)
        if _header_at(blob, i, key) is not None:
            return i
        found = [j for j in (blob.find(m, i + 1) for m in _RECORD_DIGESTS) if j != -1]
    return None


def scan_wal(blob: bytes | mmap.mmap, key: bytes) -> WalScan:
    """Every good record of a log (after its file header), skipping damage as the module docstring says."""
    out = WalScan()
    pos = _FILE_HEADER.size
    size = len(blob)
    while pos < size:
        header = _header_at(blob, pos, key)
        if header is None:
            nxt = _next_header(blob, pos + 1, key)
            if nxt is None:
                out.tail = f"{size - pos} bytes at offset {pos} hold no complete record"
                break
            out.problems.append(f"bytes {pos}..{nxt} hold no valid record (a damaged record header): skipped; "
                                "an update recorded there is lost")
            pos = nxt
            continue
        round_, org, data_len, sha, start, magic = header
        stop = start + data_len
        if stop > size:
            out.tail = (f"the record at offset {pos} (round {round_}, organization {org!r}) is cut short: "
                        f"{size - start} of {data_len} bytes")
            break
        data = bytes(blob[start:stop])
        name, digest_of = _RECORD_DIGESTS[magic]
        if digest_of(data) == sha:
            out.records.append(WalRecord(pos, round_, org, data))
            out.end = stop
        else:
            out.problems.append(f"the record at offset {pos} (round {round_}, organization {org!r}, {data_len} "
                                f"bytes) fails its {name} digest: discarded")
        pos = stop
    return out


def _record_bytes(key: bytes, round_: int, org: bytes, data_len: int, sha: bytes) -> bytes:
    signed = struct.pack("<4sqHQ32s", _REC_MAGIC, round_, len(org), data_len, sha)
    return signed + _mac(key, signed, org) + org


class WalOpen(enum.Enum):
    """What opening the log found."""

    NEW = "new"  # no log yet
    OK = "ok"  # every record verified (a cut-short tail is cut off)
    REPAIRED = "repaired"  # damaged records skipped; rewritten with the good ones
    DAMAGED = "damaged"  # the file header fails: moved aside, a new log started


class WriteAheadLog:
    """The open round's logged updates; ``open()`` once, then ``append``/``sync`` (see the module docstring)."""

    def __init__(self, path: Path, disk: Disk) -> None:
        self.path = path
        self.disk = disk
        self.found = WalOpen.NEW
        self._fd = -1
        self._key = b""
        self._size = _FILE_HEADER.size  # the end of the last good record: where the next append goes
        self._dirty = False  # bytes past _size may remain from a failed append
        self._max_round = -1  # the highest round among the logged records
        # Group commit: _sync guards the fields below and _size; appends hold the run's lock, syncs do not.
        self._sync = threading.Condition()
        self._generation = 0  # bumped whenever records are cut from the log
        self._synced_end = _FILE_HEADER.size  # every byte before it is durable
        self._syncing = False  # an fsync of the log is under way
        self._sync_failed = False  # an fsync failed: bytes past _synced_end are suspect until cut back

    def holds_records(self) -> bool:
        """Whether the file on disk holds any record (before ``open``)."""
        return self.path.exists() and self.path.stat().st_size > _FILE_HEADER.size

    def open(self) -> None:
        """Read, check and repair the log (see the module docstring); StateError when it cannot be opened."""
        path = self.path
        size = path.stat().st_size if path.exists() else 0
        records: list[WalRecord] = []
        key = b""
        state = WalOpen.NEW
        if size:
            with mapped(path) as blob:
                head = bytes(blob[: _FILE_HEADER.size])
                if len(head) == _FILE_HEADER.size and self._header_ok(head):
                    key = head[4:20]
                    scan = scan_wal(blob, key)
                    records = scan.records
                    for problem in scan.problems:
                        log.error("%s: %s", path, problem)
                    if scan.problems:
                        log.error("%s: rewritten with its %d good records; an organization whose update was lost "
                                  "is asked for it again", path, len(records))
                        state = WalOpen.REPAIRED
                    else:
                        if scan.tail:
                            log.warning("%s: %s (an append interrupted by a crash): cut off", path, scan.tail)
                        state = WalOpen.OK
                        self._size = scan.end
                else:
                    state = WalOpen.DAMAGED
        try:
            if state is WalOpen.DAMAGED:
                aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
                self.disk.replace(path, aside)
                log.error("%s: the file header is damaged, so no record in it can be verified; moved to %s. An "
                          "organization that had pushed in the open round is asked for its update again",
                          path, aside.name)
            if state is WalOpen.OK:
                self._key = key
                self._fd = self.disk.open(path)
                if self._size < size:
                    self.disk.truncate(self._fd, self._size)
                    self.disk.fsync(self._fd)
                self._log_cut(self._size)  # what was read back is on disk
            else:
                self._rewrite(key or os.urandom(16), records)
        except (OSError, StorageError) as exc:
            raise StateError(f"{path} cannot be opened or repaired ({exc})") from None
        self.found = state
        self._max_round = max((r.round for r in records), default=-1)

    @staticmethod
    def _header_ok(head: bytes) -> bool:
        magic, key, crc = _FILE_HEADER.unpack(head)
        return magic == _FILE_MAGIC and zlib.crc32(magic + key) == crc

    def _rewrite(self, key: bytes, records: list[WalRecord]) -> None:
        """Replace the log atomically by a file header and ``records`` (a new or repaired log)."""
        buf = io.BytesIO()
        buf.write(_FILE_HEADER.pack(_FILE_MAGIC, key, zlib.crc32(_FILE_MAGIC + key)))
        for r in records:
            org = r.organization.encode()
            buf.write(_record_bytes(key, r.round, org, len(r.data), content.digest(r.data)))
            buf.write(r.data)
        if self._fd >= 0:
            self._quiesce()
            self.disk.close(self._fd)
            self._fd = -1
        atomic_write(self.disk, self.path, buf.getbuffer(), checkpoint=False)
        self._fd = self.disk.open(self.path)
        self._key = key
        self._log_cut(buf.getbuffer().nbytes)
        self._dirty = False

    # ------------------------------------------------------------------------------------------ updates
    def write_update(self, round_: int, organization: str, data: bytes, digest: bytes | None = None) -> None:
        """Log an update durably: ``append_update`` and ``sync`` in one call (for callers without concurrency)."""
        ticket = self.append(round_, organization, data, digest)
        try:
            durable = self.sync(ticket)
        except StorageError as exc:
            self.repair()
            raise StorageError(self.failed_update(organization, round_, exc)) from None
        if not durable:
            raise StorageError(f"the log {self.path} was cut before the update of {organization!r} was durable")

    def failed_update(self, organization: str, round_: int, why: object) -> str:
        """The message of an update that could not be logged."""
        return f"could not log the update of {organization!r} for round {round_} in {self.path} ({why})"

    def repair(self) -> None:
        """After a failed fsync, cut the log back to its last durable point now (call with the run's lock held);
        a cut that fails itself is logged and retried before the next append."""
        if not (self._sync_failed or self._dirty):
            return
        try:
            self._cut_back()
        except OSError as exc:
            self._dirty = True
            log.error("%s: could not cut a failed append back (%s); retried before the next append",
                      self.path, exc.strerror or exc)

    def append(self, round_: int, organization: str, data: bytes | memoryview,
                      digest: bytes | None = None) -> WalTicket:
        """Write an accepted update's record at the end of the log; call with the run's lock held.

        The record is not durable yet: ``sync`` its ticket before acknowledging it. ``digest`` is the update's
        BLAKE3 digest when the caller already has it (the wire's, ``hetfed.wire.digest``). On failure the log
        is cut back to where it was and ``StorageError`` is raised: nothing was logged.
        """
        org = organization.encode()
        head = _record_bytes(self._key, round_, org, len(data), digest or content.digest(data))
        try:
            if self._dirty or self._sync_failed:
                self._cut_back()
            self.disk.pwrite(self._fd, head, self._size)
            crash_point("wal.header_written")
            view = memoryview(data).cast("B")
            for lo in range(0, view.nbytes, BLOCK_BYTES):  # a mapped push's pages go back after each block
                self.disk.pwrite(self._fd, view[lo:lo + BLOCK_BYTES], self._size + len(head) + lo)
                drop_pages(view[lo:lo + BLOCK_BYTES])
            crash_point("wal.data_written")
        except OSError as exc:
            self._dirty = True
            try:
                self._cut_back()
            except OSError as again:
                log.error("%s: could not cut a failed append back (%s); retried before the next append",
                          self.path, again.strerror or again)
            raise StorageError(self.failed_update(organization, round_, exc.strerror or exc)) from None
        with self._sync:
            self._size += len(head) + len(data)
            ticket = WalTicket(self._generation, self._size)
        self._max_round = max(self._max_round, round_)
        return ticket

    def sync(self, ticket: WalTicket) -> bool:
        """Make ``ticket``'s record durable (group commit; call it without the run's lock).

        True once it is on disk; False when the log was cut before it was (its round closed meanwhile, or a
        failed fsync voided it and the log has been cut back since). One fsync at a time covers every record
        written before it started, so callers that arrive meanwhile wait for the next one and share it.
        Raises ``StorageError`` when the fsync that should cover the record fails.
        """
        while True:
            with self._sync:
                while True:
                    if ticket.generation != self._generation:
                        return False
                    if self._synced_end >= ticket.end:
                        return True
                    if self._sync_failed:
                        raise StorageError("an earlier fsync of the log failed")
                    if not self._syncing:
                        break
                    self._sync.wait()
                self._syncing = True
                target, generation, fd = self._size, self._generation, self._fd
            failure: OSError | None = None
            try:
                crash_point("wal.syncing")
                self.disk.fsync(fd)
            except OSError as exc:
                failure = exc
            with self._sync:
                self._syncing = False
                if generation == self._generation:
                    if failure is None:
                        self._synced_end = max(self._synced_end, target)
                    else:
                        self._sync_failed = True
                self._sync.notify_all()
            if failure is not None:
                raise StorageError(f"its fsync failed: {failure.strerror or failure}")
            crash_point("wal.synced")

    def _cut_back(self) -> None:
        """Cut the log back to its last good record (to the last durable point after a failed fsync)."""
        with self._sync:
            self._sync.wait_for(lambda: not self._syncing)
            keep = self._synced_end if self._sync_failed else self._size
        self.disk.truncate(self._fd, keep)
        self.disk.fsync(self._fd)
        with self._sync:
            if self._sync_failed or keep < self._size:
                self._generation += 1
            self._sync_failed = False
            self._size = self._synced_end = keep
            self._sync.notify_all()
        self._dirty = False

    def _log_cut(self, size: int) -> None:
        """The log now ends at ``size`` (rewritten or truncated): a new generation voids the old tickets."""
        with self._sync:
            self._generation += 1
            self._size = self._synced_end = size
            self._sync_failed = False
            self._sync.notify_all()

    def _quiesce(self) -> None:
        """Wait until no fsync of the log is under way (before its descriptor is closed)."""
        with self._sync:
            self._sync.wait_for(lambda: not self._syncing)

    def updates(self, round_: int) -> list[tuple[str, bytes]]:
        """Every logged update of a round, in organization order (read from disk: for restores)."""
        found: dict[str, bytes] = {}
        with mapped(self.path) as blob:
            scan = scan_wal(blob[: self._size], self._key)
        found.update((r.organization, r.data) for r in scan.records if r.round == round_)
        return sorted(found.items())

    def views(self, round_: int) -> list[tuple[str, memoryview]]:
        """Every logged update of a round, in organization order, as read-only views of the log file: mapped, not
        read, so the kernel pages the bytes in as they are used and a caller may drop them again
        (``madvise``). Only the record headers are read (their MACs checked): every record was verified when the
        log was opened or appended. The views stay valid until the round's records are cut from the log."""
        size = self._size
        if size <= _FILE_HEADER.size:
            return []
        with open(self.path, "rb") as f:
            blob = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        whole = memoryview(blob)
        found: dict[str, memoryview] = {}
        pos = _FILE_HEADER.size
        while pos < size:
            header = _header_at(blob, pos, self._key)
            if header is None:  # not reached: the log holds only verified records up to its end
                raise StorageError(f"{self.path}: no valid record at offset {pos}")
            rec_round, org, data_len, _, start, _ = header
            if rec_round == round_:
                found[org] = whole[start : start + data_len]
            pos = start + data_len
        return sorted(found.items())

    def drop_rounds_before(self, round_: int) -> None:
        """Forget logged updates of rounds before ``round_`` (their effect is in the checkpoint).

        A failure is logged, not raised: stale records name closed rounds, which no restore replays.
        """
        if self._size == _FILE_HEADER.size:
            return
        try:
            if self._max_round >= round_:  # not reached by the engine, which drops after closing
                keep = [r for r in self._scan_own() if r.round >= round_]
                self._rewrite(self._key, keep)
                self._max_round = max(r.round for r in keep)
            else:
                # No fsync: should a crash undo the cut, the records name closed rounds and are never replayed.
                self.disk.truncate(self._fd, _FILE_HEADER.size)
                crash_point("wal.truncated")
                self._log_cut(_FILE_HEADER.size)
                self._dirty = False
                self._max_round = -1
        except (OSError, StorageError) as exc:
            log.warning("%s: could not cut the closed rounds' records (%s); they stay, and are never replayed",
                        self.path, exc)

    def _scan_own(self) -> list[WalRecord]:
        with mapped(self.path) as blob:
            return scan_wal(blob[: self._size], self._key).records

    def close(self) -> None:
        """Close the log's file."""
        self._quiesce()
        if self._fd >= 0:
            with suppress(OSError):
                self.disk.close(self._fd)
        self._fd = -1
