"""Durable run state with explicit failure semantics: what is acknowledged is on disk, what failed left no trace.

A run's directory holds three files:

- ``checkpoint.npz``: the run's metadata (JSON) and its server half's arrays, replaced atomically (temporary
  file, fsync, rename, fsync of the directory). It is the commit point of a round's close and of a join.
- ``history.jsonl``: one JSON line per closed round, with the CRC-32 of its content. A closing round's line is written and fsync'd at the end
  of the committed lines *before* the checkpoint that counts it (``history_len``); a line beyond that count
  (a close whose checkpoint never landed) is cut off at start-up and overwritten by the retried close. The
  checkpoint also keeps a copy of the last committed line, so a torn last line is repaired from it. The
  engine writes the line (``append_history``) before it wakes the round's clients and the checkpoint that
  counts it (``commit_close``) after, while the closed round's log records are kept until it is on disk.
- ``updates.wal``: the open round's accepted updates. A file header holds a random key; each record is a
  header (magic, round, lengths, SHA-256 of the update, a MAC keyed by the file's key over the header and
  the organization) followed by the organization and the update. An update is appended at the end of the
  last good record and fsync'd before it is acknowledged; an append that fails is cut back (truncate, fsync)
  so the log is exactly as it was, and the caller answers a retryable status. Appends are written under the
  run's lock and made durable outside it with group commit (``append_update``, then ``sync``): one fsync
  covers every record written before it started, so concurrent pushes share it. A failed fsync leaves every
  record past the last durable point suspect: each of them is answered with a retryable status and the log
  is cut back to that point before the next append.

Recovery at start-up: a record cut short at the end of the log (an interrupted append) is cut off. A record
whose header verifies but whose update fails its SHA-256 is discarded alone: its length is trusted, so the
next record is found. A record whose header fails its MAC has untrusted lengths: the log is searched for the
next header that verifies (the MAC is keyed, so bytes inside an update cannot pose as a record), and what
lies between is skipped. Damage is logged with offsets, round and organization, and the log is rewritten
without it. A missing or unreadable checkpoint next to existing history or log records, or a history line the
checkpoint counts that cannot be read or repaired, is refused with ``StateError`` naming the file: the run
is never silently started over.

Every file operation goes through ``Disk`` (``DISK``), so tests can make any of them fail.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import io
import json
import logging
import mmap
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.aggregator.crashpoints import crash_point

log = logging.getLogger("hetfed.aggregator")


class StorageError(Exception):
    """A write to the state directory failed; what it was part of did not happen, and may be retried."""


class StateError(Exception):
    """The state directory cannot be resumed as it is; the message names the file and what is wrong."""


class RunConflictError(StateError):
    """A run's stored state is sound but conflicts with its config (another algorithm under the same id): the
    aggregator refuses that run and serves the others."""


class Disk:
    """The store's file operations, in one place so tests and the fault harness can make any of them fail."""

    def open(self, path: Path) -> int:
        """Open (creating) a file for reading and writing at explicit offsets."""
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (looping over partial writes)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n

    def fsync(self, fd: int) -> None:
        """Make a file's data durable."""
        os.fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        """Cut a file to ``size`` bytes."""
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        """Close a file descriptor."""
        os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        """Rename ``src`` over ``dst`` atomically."""
        os.replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        """Make a directory's entries (a rename) durable."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


DISK = Disk()

# updates.wal: a file header, then records.
_FILE_MAGIC = b"HFW2"
_FILE_HEADER = struct.Struct("<4s16sI")  # magic, key, CRC-32 of magic and key
_REC_MAGIC = b"HFR2"
# magic, round, organization length, update length, SHA-256 of the update, MAC of the header and organization
_REC = struct.Struct("<4sqHQ32s16s")
_REC_SIGNED = _REC.size - 16  # the header bytes the MAC covers (all but the MAC)
# The log before this format: records without a file header or MAC, read once and converted.
_LEGACY_REC = struct.Struct("<4sqHQ32s")
_LEGACY_MAGIC = b"HFU1"


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


def _header_at(blob: bytes | mmap.mmap, pos: int, key: bytes) -> tuple[int, str, int, bytes, int] | None:
    """(round, organization, update length, update SHA-256, update offset) of a verified header at ``pos``."""
    if pos + _REC.size > len(blob):
        return None
    magic, round_, org_len, data_len, sha, mac = _REC.unpack_from(blob, pos)
    if magic != _REC_MAGIC:
        return None
    start = pos + _REC.size + org_len
    if start > len(blob):
        return None
    org = bytes(blob[pos + _REC.size : start])
    if not hmac.compare_digest(_mac(key, blob[pos : pos + _REC_SIGNED], org), mac):
        return None
    return round_, org.decode(errors="replace"), data_len, sha, start


def _next_header(blob: bytes | mmap.mmap, start: int, key: bytes) -> int | None:
    """The offset of the next verified record header at or after ``start``."""
    i = blob.find(_REC_MAGIC, start)
    while i != -1:
        if _header_at(blob, i, key) is not None:
            return i
        i = blob.find(_REC_MAGIC, i + 1)
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
        round_, org, data_len, sha, start = header
        stop = start + data_len
        if stop > size:
            out.tail = (f"the record at offset {pos} (round {round_}, organization {org!r}) is cut short: "
                        f"{size - start} of {data_len} bytes")
            break
        data = bytes(blob[start:stop])
        if hashlib.sha256(data).digest() == sha:
            out.records.append(WalRecord(pos, round_, org, data))
            out.end = stop
        else:
            out.problems.append(f"the record at offset {pos} (round {round_}, organization {org!r}, {data_len} "
                                "bytes) fails its SHA-256: discarded")
        pos = stop
    return out


def _legacy_records(blob: bytes) -> tuple[list[WalRecord], int]:
    """The valid records of a log in the format before the file header, and the length of that prefix."""
    out: list[WalRecord] = []
    pos = 0
    while pos + _LEGACY_REC.size <= len(blob):
        magic, round_, org_len, data_len, digest = _LEGACY_REC.unpack_from(blob, pos)
        end = pos + _LEGACY_REC.size + org_len + data_len
        if magic != _LEGACY_MAGIC or end > len(blob):
            break
        body = blob[pos + _LEGACY_REC.size : end]
        if hashlib.sha256(body).digest() != digest:
            break
        out.append(WalRecord(pos, round_, body[:org_len].decode(), body[org_len:]))
        pos = end
    return out, pos


def _record_bytes(key: bytes, round_: int, org: bytes, data_len: int, sha: bytes) -> bytes:
    signed = struct.pack("<4sqHQ32s", _REC_MAGIC, round_, len(org), data_len, sha)
    return signed + _mac(key, signed, org) + org


# Each history line carries the CRC-32 of the rest of its JSON object (lines written before it have none).
_LINE_CRC = "crc32"


def _line_crc(record: dict[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps(record).encode()):08x}"


def _history_line(record: dict[str, Any]) -> bytes:
    return json.dumps({**record, _LINE_CRC: _line_crc(record)}).encode() + b"\n"


@contextmanager
def _mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """A file's bytes, memory-mapped (the log may be large)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            yield m


@dataclass
class Recovered:
    """A run's durable state, read at start-up: checkpoint metadata and arrays, committed history, notes."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    history: list[dict[str, Any]]


def holder_of(run_dir: Path) -> str | None:
    """Who holds the lock of a run's state directory (an aggregator serving it), or None when nobody does."""
    path = run_dir / "lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)
    return None


def _holder(fd: int) -> str:
    """What the holder of a run directory's lock wrote into it ("pid N")."""
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"


class RunStore:
    """One run's directory: ``checkpoint.npz``, ``history.jsonl`` and ``updates.wal``.

    Construct it, then call ``recover()`` once before anything else: it checks and repairs the files and
    returns the durable state (None for a new run).
    """

    def __init__(self, root: str | Path, run_id: str, disk: Disk | None = None) -> None:
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.disk = disk or DISK
        self.checkpoint_path = self.dir / "checkpoint.npz"
        self.wal_path = self.dir / "updates.wal"
        self.history_path = self.dir / "history.jsonl"
        self._wal_fd = -1
        self._wal_key = b""
        self._wal_size = _FILE_HEADER.size  # the end of the last good record: where the next append goes
        self._wal_dirty = False  # bytes past _wal_size may remain from a failed append
        self._wal_max_round = -1  # the highest round among the logged records
        # Group commit: _sync guards the fields below and _wal_size; appends hold the run's lock, syncs do not.
        self._sync = threading.Condition()
        self._generation = 0  # bumped whenever records are cut from the log
        self._synced_end = _FILE_HEADER.size  # every byte before it is durable
        self._syncing = False  # an fsync of the log is under way
        self._sync_failed = False  # an fsync failed: bytes past _synced_end are suspect until cut back
        self._hist_fd = -1
        self._hist_size = 0  # bytes of the committed lines
        self._hist_count = 0
        self._hist_dirty = False  # bytes past _hist_size may remain (an uncommitted or failed append)
        self._last_record: dict[str, Any] | None = None
        self._pending_line: tuple[dict[str, Any], int] | None = None  # (record, bytes) written, not yet counted
        self._lock_fd = -1

    def _lock(self) -> None:
        """Hold an exclusive lock on the run's directory for this store's lifetime: a second aggregator on
        the same state directory (a stale process, a copy started by hand) would interleave its writes with
        this one's, so it is refused, naming the holder."""
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateError(f"{self.dir} is in use by another aggregator ({holder}); stop it first, or give "
                             "this one another state_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    # ------------------------------------------------------------------------------------------ start-up
    def recover(self) -> Recovered | None:
        """Check and repair the run's files; the durable state, or None for a new run. Raises StateError."""
        if self._lock_fd < 0:
            self._lock()
        for stale in self.dir.glob(".checkpoint.npz.tmp*"):
            stale.unlink(missing_ok=True)
        if not self.checkpoint_path.exists():
            found = []
            if self.history_path.exists() and self.history_path.stat().st_size:
                found.append(f"{self.history_path.name} holds closed rounds")
            if self.wal_path.exists() and self.wal_path.stat().st_size > _FILE_HEADER.size:
                found.append(f"{self.wal_path.name} holds {self.wal_path.stat().st_size} bytes of updates")
            if any(self.dir.glob("round-*")):
                found.append("round-* directories hold updates")
            if found:
                raise StateError(
                    f"{self.checkpoint_path} is missing, but {' and '.join(found)}: the run's state is incomplete, "
                    "and starting the run over would discard it. Restore checkpoint.npz from a backup, or move "
                    f"{self.dir} aside to start run {self.dir.name!r} from its first round")
            self._open_history(0, None)
            self._open_wal()
            return None
        meta, arrays = self.read_checkpoint()
        if "history" in meta:  # an older checkpoint kept the history itself
            history = list(meta["history"])
            self._open_history(0, None)
        else:
            history = self._open_history(int(meta.get("history_len", 0)), meta.get("last_record"))
        self._last_record = meta.get("last_record")
        self._open_wal()
        return Recovered(meta, arrays, history)

    def read_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The checkpoint's metadata and arrays; StateError names the file when it cannot be read."""
        path = self.checkpoint_path
        try:
            with np.load(path) as z:
                if "meta" not in z.files:
                    raise StateError(f"{path} has no metadata record: it is not a hetfed checkpoint")
                meta = json.loads(bytes(z["meta"]).decode())
                arrays = {k[2:]: z[k] for k in z.files if k.startswith("a/")}
        except StateError:
            raise
        except Exception as exc:  # a truncated or damaged zip fails in many ways; every one is a clear refusal
            raise StateError(
                f"{path} cannot be read ({type(exc).__name__}: {exc}). It is the run's only copy of its server "
                "state: restore it from a backup; the aggregator will not start the run over it") from None
        if not isinstance(meta, dict):
            raise StateError(f"{path} holds metadata of type {type(meta).__name__}, not an object")
        return meta, arrays

    def _open_history(self, count: int, last: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The ``count`` committed records; lines past them are cut off, a torn last one repaired from ``last``."""
        path = self.history_path
        blob = path.read_bytes() if path.exists() else b""
        records: list[dict[str, Any]] = []
        pos = 0
        problem = ""
        while len(records) < count:
            nl = blob.find(b"\n", pos)
            line = blob[pos:] if nl == -1 else blob[pos:nl]
            what = f"line {len(records) + 1} of the {count} the checkpoint counts"
            if nl == -1:
                problem = f"{what} is missing" if not line else f"{what} is cut short ({len(line)} bytes)"
                break
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError) as exc:
                problem = f"{what} is not JSON ({exc})"
                break
            if not isinstance(rec, dict):
                problem = f"{what} is not a JSON object"
                break
            crc = rec.pop(_LINE_CRC, None)
            if crc is not None and crc != _line_crc(rec):
                problem = f"{what} fails its CRC-32"
                break
            records.append(rec)
            pos = nl + 1
        repaired = b""
        if problem:
            if len(records) == count - 1 and isinstance(last, dict):
                repaired = _history_line(last)
                records.append(last)
                log.warning("%s: %s; rewritten from the checkpoint's copy", path, problem)
            else:
                raise StateError(f"{path}: {problem}. The closed rounds' records cannot be rebuilt: restore the "
                                 "file from a backup")
        if pos < len(blob) and not repaired:
            log.info("%s: cut off %d bytes after the %d committed rounds (a close that did not complete)",
                     path, len(blob) - pos, count)
        try:
            self._hist_fd = self.disk.open(path)
            if repaired or pos < len(blob):
                self.disk.truncate(self._hist_fd, pos)
                if repaired:
                    self.disk.pwrite(self._hist_fd, repaired, pos)
                self.disk.fsync(self._hist_fd)
        except OSError as exc:
            raise StateError(f"{path} cannot be repaired ({exc.strerror or exc})") from None
        self._hist_size = pos + len(repaired)
        self._hist_count = count
        return records

    def _open_wal(self) -> None:
        path = self.wal_path
        size = path.stat().st_size if path.exists() else 0
        records: list[WalRecord] = []
        key = b""
        state = "new"
        if size:
            with _mapped(path) as blob:
                head = bytes(blob[: _FILE_HEADER.size])
                if head[:4] == _LEGACY_MAGIC:
                    records, _ = _legacy_records(bytes(blob))
                    log.info("%s: converted %d records to the current log format", path, len(records))
                    state = "legacy"
                elif len(head) == _FILE_HEADER.size and self._header_ok(head):
                    key = head[4:20]
                    scan = scan_wal(blob, key)
                    records = scan.records
                    for problem in scan.problems:
                        log.error("%s: %s", path, problem)
                    if scan.problems:
                        log.error("%s: rewritten with its %d good records; an organization whose update was lost "
                                  "is asked for it again", path, len(records))
                        state = "repaired"
                    else:
                        if scan.tail:
                            log.warning("%s: %s (an append interrupted by a crash): cut off", path, scan.tail)
                        state = "ok"
                        self._wal_size = scan.end
                else:
                    state = "damaged"
        try:
            if state == "damaged":
                aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
                self.disk.replace(path, aside)
                log.error("%s: the file header is damaged, so no record in it can be verified; moved to %s. An "
                          "organization that had pushed in the open round is asked for its update again",
                          path, aside.name)
            if state == "ok":
                self._wal_key = key
                self._wal_fd = self.disk.open(path)
                if self._wal_size < size:
                    self.disk.truncate(self._wal_fd, self._wal_size)
                    self.disk.fsync(self._wal_fd)
                self._log_cut(self._wal_size)  # what was read back is on disk
            else:
                self._rewrite_wal(key or os.urandom(16), records)
        except (OSError, StorageError) as exc:
            raise StateError(f"{path} cannot be opened or repaired ({exc})") from None
        self._wal_max_round = max((r.round for r in records), default=-1)

    @staticmethod
    def _header_ok(head: bytes) -> bool:
        magic, key, crc = _FILE_HEADER.unpack(head)
        return magic == _FILE_MAGIC and zlib.crc32(magic + key) == crc

    def _rewrite_wal(self, key: bytes, records: list[WalRecord]) -> None:
        """Replace the log atomically by a file header and ``records`` (a new or repaired log)."""
        buf = io.BytesIO()
        buf.write(_FILE_HEADER.pack(_FILE_MAGIC, key, zlib.crc32(_FILE_MAGIC + key)))
        for r in records:
            org = r.organization.encode()
            buf.write(_record_bytes(key, r.round, org, len(r.data), hashlib.sha256(r.data).digest()))
            buf.write(r.data)
        if self._wal_fd >= 0:
            self._quiesce()
            self.disk.close(self._wal_fd)
            self._wal_fd = -1
        self._atomic_write(self.wal_path, buf.getbuffer(), checkpoint=False)
        self._wal_fd = self.disk.open(self.wal_path)
        self._wal_key = key
        self._log_cut(buf.getbuffer().nbytes)
        self._wal_dirty = False

    # ------------------------------------------------------------------------------------------ updates
    def write_update(self, round_: int, organization: str, data: bytes, sha256: bytes | None = None) -> None:
        """Log an update durably: ``append_update`` and ``sync`` in one call (for callers without concurrency)."""
        ticket = self.append_update(round_, organization, data, sha256)
        try:
            durable = self.sync(ticket)
        except StorageError as exc:
            self.repair()
            raise StorageError(self.failed_update(organization, round_, exc)) from None
        if not durable:
            raise StorageError(f"the log {self.wal_path} was cut before the update of {organization!r} was durable")

    def failed_update(self, organization: str, round_: int, why: object) -> str:
        """The message of an update that could not be logged."""
        return f"could not log the update of {organization!r} for round {round_} in {self.wal_path} ({why})"

    def repair(self) -> None:
        """After a failed fsync, cut the log back to its last durable point now (call with the run's lock held);
        a cut that fails itself is logged and retried before the next append."""
        if not (self._sync_failed or self._wal_dirty):
            return
        try:
            self._cut_wal_back()
        except OSError as exc:
            self._wal_dirty = True
            log.error("%s: could not cut a failed append back (%s); retried before the next append",
                      self.wal_path, exc.strerror or exc)

    def append_update(self, round_: int, organization: str, data: bytes | memoryview,
                      sha256: bytes | None = None) -> WalTicket:
        """Write an accepted update's record at the end of the log; call with the run's lock held.

        The record is not durable yet: ``sync`` its ticket before acknowledging it. ``sha256`` is the update's
        SHA-256 when the caller already has it. On failure the log is cut back to where it was and
        ``StorageError`` is raised: nothing was logged.
        """
        org = organization.encode()
        head = _record_bytes(self._wal_key, round_, org, len(data), sha256 or hashlib.sha256(data).digest())
        try:
            if self._wal_dirty or self._sync_failed:
                self._cut_wal_back()
            self.disk.pwrite(self._wal_fd, head, self._wal_size)
            crash_point("wal.header_written")
            self.disk.pwrite(self._wal_fd, data, self._wal_size + len(head))
            crash_point("wal.data_written")
        except OSError as exc:
            self._wal_dirty = True
            try:
                self._cut_wal_back()
            except OSError as again:
                log.error("%s: could not cut a failed append back (%s); retried before the next append",
                          self.wal_path, again.strerror or again)
            raise StorageError(self.failed_update(organization, round_, exc.strerror or exc)) from None
        with self._sync:
            self._wal_size += len(head) + len(data)
            ticket = WalTicket(self._generation, self._wal_size)
        self._wal_max_round = max(self._wal_max_round, round_)
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
                target, generation, fd = self._wal_size, self._generation, self._wal_fd
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

    def _cut_wal_back(self) -> None:
        """Cut the log back to its last good record (to the last durable point after a failed fsync)."""
        with self._sync:
            self._sync.wait_for(lambda: not self._syncing)
            keep = self._synced_end if self._sync_failed else self._wal_size
        self.disk.truncate(self._wal_fd, keep)
        self.disk.fsync(self._wal_fd)
        with self._sync:
            if self._sync_failed or keep < self._wal_size:
                self._generation += 1
            self._sync_failed = False
            self._wal_size = self._synced_end = keep
            self._sync.notify_all()
        self._wal_dirty = False

    def _log_cut(self, size: int) -> None:
        """The log now ends at ``size`` (rewritten or truncated): a new generation voids the old tickets."""
        with self._sync:
            self._generation += 1
            self._wal_size = self._synced_end = size
            self._sync_failed = False
            self._sync.notify_all()

    def _quiesce(self) -> None:
        """Wait until no fsync of the log is under way (before its descriptor is closed)."""
        with self._sync:
            self._sync.wait_for(lambda: not self._syncing)

    def updates(self, round_: int) -> list[tuple[str, bytes]]:
        """Every logged update of a round, in organization order (read from disk: for restores)."""
        found: dict[str, bytes] = {}
        legacy = self.dir / f"round-{round_:06d}"  # the layout before the write-ahead log
        if legacy.is_dir():
            found.update((p.stem, p.read_bytes()) for p in legacy.glob("*.update"))
        with _mapped(self.wal_path) as blob:
            scan = scan_wal(blob[: self._wal_size], self._wal_key)
        found.update((r.organization, r.data) for r in scan.records if r.round == round_)
        return sorted(found.items())

    def drop_rounds_before(self, round_: int) -> None:
        """Forget logged updates of rounds before ``round_`` (their effect is in the checkpoint).

        A failure is logged, not raised: stale records name closed rounds, which no restore replays.
        """
        for d in self.dir.glob("round-*"):
            if int(d.name.split("-")[1]) < round_:
                shutil.rmtree(d, ignore_errors=True)
        if self._wal_size == _FILE_HEADER.size:
            return
        try:
            if self._wal_max_round >= round_:  # not reached by the engine, which drops after closing
                keep = [r for r in self._scan_own() if r.round >= round_]
                self._rewrite_wal(self._wal_key, keep)
                self._wal_max_round = max(r.round for r in keep)
            else:
                # No fsync: should a crash undo the cut, the records name closed rounds and are never replayed.
                self.disk.truncate(self._wal_fd, _FILE_HEADER.size)
                crash_point("wal.truncated")
                self._log_cut(_FILE_HEADER.size)
                self._wal_dirty = False
                self._wal_max_round = -1
        except (OSError, StorageError) as exc:
            log.warning("%s: could not cut the closed rounds' records (%s); they stay, and are never replayed",
                        self.wal_path, exc)

    def _scan_own(self) -> list[WalRecord]:
        with _mapped(self.wal_path) as blob:
            return scan_wal(blob[: self._wal_size], self._wal_key).records

    # ------------------------------------------------------------------------------------------ commits
    def save_checkpoint(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Atomically replace the checkpoint (the history it counts unchanged); StorageError leaves the old one."""
        self._write_checkpoint({**meta, "history_len": self._hist_count, "last_record": self._last_record}, arrays)

    def close_round(self, record: dict[str, Any], meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Commit a round's close: its history line (fsync'd), then the checkpoint that counts it.

        On ``StorageError`` nothing is committed: the old checkpoint stands, and a line written past the
        committed history is overwritten by the retried close (or cut off at start-up).
        """
        self.append_history(record)
        self.commit_close(meta, arrays)

    def append_history(self, record: dict[str, Any]) -> None:
        """Write and fsync a closing round's history line past the committed lines (not yet counted: the
        checkpoint of ``commit_close`` counts it). A line written before and never counted is replaced."""
        line = _history_line(record)
        self._pending_line = None
        try:
            if self._hist_dirty:
                self.disk.truncate(self._hist_fd, self._hist_size)
            self._hist_dirty = True
            self.disk.pwrite(self._hist_fd, line, self._hist_size)
            crash_point("history.written")
            self.disk.fsync(self._hist_fd)
            crash_point("history.synced")
        except OSError as exc:
            raise StorageError(f"could not append round {record.get('round')}'s record to {self.history_path} "
                               f"({exc.strerror or exc})") from None
        self._pending_line = (record, len(line))

    def commit_close(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Write the checkpoint that counts the line of ``append_history``: the close's commit point. On
        ``StorageError`` the old checkpoint stands and the call may be repeated with the same arguments."""
        if self._pending_line is None:
            raise StorageError("no closing round's history line to commit")
        record, size = self._pending_line
        self._write_checkpoint({**meta, "history_len": self._hist_count + 1, "last_record": record}, arrays)
        self._hist_size += size
        self._hist_count += 1
        self._hist_dirty = False
        self._last_record = record
        self._pending_line = None

    def _write_checkpoint(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        buf = io.BytesIO()
        payload = {f"a/{k}": v for k, v in arrays.items()}
        payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez(buf, **payload)  # type: ignore[arg-type]
        self._atomic_write(self.checkpoint_path, buf.getbuffer(), checkpoint=True)

    def _atomic_write(self, path: Path, data: bytes | memoryview, checkpoint: bool) -> None:
        """Replace ``path`` by ``data`` so that a crash leaves the old file or the new one; StorageError if not."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            fd = self.disk.open(tmp)
            try:
                self.disk.truncate(fd, 0)
                self.disk.pwrite(fd, data, 0)
                if checkpoint:
                    crash_point("checkpoint.tmp_written")
                self.disk.fsync(fd)
                if checkpoint:
                    crash_point("checkpoint.tmp_synced")
            finally:
                self.disk.close(fd)
            self.disk.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"could not write {path} ({exc.strerror or exc})") from None
        if checkpoint:
            crash_point("checkpoint.replaced")
        try:
            self.disk.fsync_dir(path.parent)
        except OSError as exc:  # the new file is in place; only its survival of a power loss is uncertain
            log.warning("%s: could not fsync the directory after replacing %s (%s)", path.parent, path.name,
                        exc.strerror or exc)

    def close(self) -> None:
        """Close the files."""
        self._quiesce()
        for fd in (self._wal_fd, self._hist_fd):
            if fd >= 0:
                with suppress(OSError):
                    self.disk.close(fd)
        self._wal_fd = self._hist_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the directory's lock
            self._lock_fd = -1
