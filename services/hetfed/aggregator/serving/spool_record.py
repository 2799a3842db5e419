"""The durable record of a partial push: a small file beside its spool file that says which push it is and how
much of the spool file is durable.

A partial push's spool file ``<organization>-<round>-<tag>.part`` is fsync'd, then its record
``<organization>-<round>-<tag>.json`` is written atomically (a temporary file fsync'd, renamed over the record,
the directory fsync'd). The record names the push (run, organization, round, BLAKE3 digest of the whole
update, announced chunk count and bytes) and its durable prefix: the chunks and bytes fsync'd before the record
was written, and the BLAKE3 digest of those bytes. A restarted aggregator cuts the file to that prefix and hashes
it again, in blocks; bytes that do not hash to the record's digest are not resumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.wire import digest as content

# The record's format; another version is not read (its push starts again from chunk 0).
VERSION = 1
RECORD_SUFFIX = ".json"
# Bytes read at a time when a restarted aggregator hashes a spool file's durable prefix again.
REHASH_BLOCK_BYTES = 8 << 20


class RecordError(Exception):
    """A record, or the spool file it describes, that cannot be resumed; ``reason`` is the metric's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Record:
    """Which push a spool file holds, and its durable prefix (``chunks`` chunks, ``held_bytes`` bytes)."""

    run_id: str
    organization: str
    round: int
    digest: bytes  # of the whole update, as the push named it (update_blake3)
    count: int  # chunks the push announced
    total_bytes: int  # bytes the push announced
    chunks: int
    held_bytes: int
    prefix_digest: bytes  # of the first ``held_bytes`` bytes
    wire_bytes: int = 0  # the messages that carried the ``chunks`` chunks, for the push's traffic record
    messages: int = 0

    def to_json(self) -> bytes:
        """The record's bytes: its fields and a BLAKE3 check of them."""
        fields = {k: v.hex() if isinstance(v, bytes) else v for k, v in asdict(self).items()}
        body = json.dumps({"version": VERSION, **fields}, sort_keys=True)
        return json.dumps({"record": body, "blake3": content.digest(body.encode()).hex()}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        """The record in ``raw``; RecordError ``invalid`` when it is torn, damaged or of another version."""
        try:
            outer = json.loads(raw)
            body = outer["record"]
            if content.digest(body.encode()).hex() != outer["blake3"]:
                raise RecordError("invalid", "its check does not match its fields (a damaged record)")
            fields = json.loads(body)
            if fields.pop("version") != VERSION:
                raise RecordError("invalid", "a record of another format version")
            for name in ("digest", "prefix_digest"):
                fields[name] = bytes.fromhex(fields[name])
            record = cls(**fields)
        except RecordError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError("invalid", f"not a partial push's record ({exc.__class__.__name__}: {exc})") from None
        record.check()
        return record

    def check(self) -> None:
        """RecordError ``invalid`` unless the fields describe a started, unfinished push."""
        ints = (self.round, self.count, self.total_bytes, self.chunks, self.held_bytes, self.wire_bytes, self.messages)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise RecordError("invalid", "a count that is not an integer")
        if not all(isinstance(s, str) and s for s in (self.run_id, self.organization)):
            raise RecordError("invalid", "no run or organization")
        if len(self.digest) != content.SIZE or len(self.prefix_digest) != content.SIZE:
            raise RecordError("invalid", "a digest that is not BLAKE3's 32 bytes")
        if not (1 <= self.chunks < self.count <= max(1, self.total_bytes) and 0 <= self.held_bytes <= self.total_bytes
                and self.round >= 0):
            raise RecordError("invalid", f"{self.chunks} of {self.count} chunks, {self.held_bytes} of "
                                         f"{self.total_bytes} bytes: not a partial push")


def record_path(part: Path) -> Path:
    """The record beside the spool file ``part``."""
    return part.with_suffix(RECORD_SUFFIX)


def sync_data(fd: int) -> None:
    """Make a spool file's bytes and length durable (fdatasync: its other metadata does not matter)."""
    getattr(os, "fdatasync", os.fsync)(fd)


def write_record(part: Path, record: Record, lock: threading.Lock | None = None,
                 wanted: Callable[[], bool] = lambda: True) -> None:
    """Replace ``part``'s record with ``record`` atomically and durably (the spool file already fsync'd).

    The rename happens under ``lock`` and only while ``wanted()``: the push's files are deleted under the same
    lock, and a record must not outlive them."""
    path = record_path(part)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        raw = record.to_json()
        if os.write(fd, raw) != len(raw):
            raise OSError(f"a short write of {tmp}")
        os.fsync(fd)
    finally:
        os.close(fd)
    crash_point("spool.synced")
    with lock or contextlib.nullcontext():
        if not wanted():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            return
        os.replace(tmp, path)
        sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Make the names in ``directory`` durable (a new spool file's, a renamed record's)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(part: Path) -> Record:
    """``part``'s record (RecordError ``invalid`` when it cannot be read)."""
    try:
        raw = record_path(part).read_bytes()
    except OSError as exc:
        raise RecordError("invalid", f"unreadable ({exc.strerror})") from None
    return Record.from_json(raw)


def remove(part: Path) -> None:
    """Delete a spool file, its record and a record being written (the record first: a file without its record
    is never resumed)."""
    path = record_path(part)
    for p in (path, path.with_name(path.name + ".tmp"), part):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def rehash(fd: int, length: int, block: int = REHASH_BLOCK_BYTES) -> content.Hasher:
    """The hash state of the first ``length`` bytes of the file ``fd``, read ``block`` bytes at a time (one
    buffer: a 1 GB partial push is not read into memory whole). RecordError ``torn`` when the file is shorter."""
    hasher = content.hasher()
    buffer = bytearray(min(block, max(length, 1)))
    view = memoryview(buffer)
    offset = 0
    while offset < length:
        n = os.preadv(fd, [view[:min(block, length - offset)]], offset)
        if n <= 0:
            raise RecordError("torn", f"the file ends at {offset} bytes, its record claims {length}")
        hasher.update(view[:n])
        offset += n
    return hasher


def part_name(organization: str, round_: int, tag: str) -> str:
    """The spool file's name of a push (``tag``: its digest's first 8 bytes in hex, or a stream's number)."""
    return f"{organization}-{round_}-{tag}.part"


@dataclass(frozen=True)
class Loaded:
    """A partial push of an earlier process, ready to resume: its spool file (open, cut to its durable prefix),
    its record and the hash of that prefix."""

    part: Path
    record: Record
    fd: int
    hash_state: content.Hasher


def load(part: Path, run_id: str, max_update_bytes: int, round_open: Callable[[str, str, int], bool]) -> Loaded:
    """The partial push in ``part`` and its record (RecordError with the reason when it cannot be resumed: the
    caller deletes both)."""
    record = read_record(part)
    if record.run_id != run_id or part.name != part_name(record.organization, record.round, record.digest[:8].hex()):
        raise RecordError("invalid", f"a record of run {record.run_id!r}, organization {record.organization!r} "
                                     f"round {record.round}, under another name")
    if record.total_bytes > max_update_bytes:
        raise RecordError("invalid", f"a push of {record.total_bytes} bytes, over server.max_update_bytes")
    if not round_open(record.run_id, record.organization, record.round):
        raise RecordError("round_closed", f"round {record.round} is no longer open to {record.organization}")
    try:
        fd = os.open(part, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RecordError("torn", "its spool file is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size < record.held_bytes:
            raise RecordError("torn", f"the file holds {size} bytes, its record claims {record.held_bytes}")
        os.ftruncate(fd, record.held_bytes)  # what was written after the record is not known to be whole
        hash_state = rehash(fd, record.held_bytes)
        if hash_state.digest() != record.prefix_digest:
            raise RecordError("torn", f"its first {record.held_bytes} bytes do not hash to its record's digest")
    except BaseException:
        os.close(fd)
        raise
    return Loaded(part, record, fd, hash_state)


def scan(folder: Path, run_id: str, max_update_bytes: int, round_open: Callable[[str, str, int], bool],
         dropped: Callable[[Path, str, str], None]) -> list[Loaded]:
    """The partial pushes in a run's spool folder that can be resumed, the latest record of each organization's;
    every other file is deleted (``dropped(part, reason, why)`` for each partial push that is not resumed)."""
    try:
        names = sorted(folder.iterdir())
    except FileNotFoundError:
        return []
    loaded: dict[str, Loaded] = {}
    for path in names:
        if path.suffix == ".part" and record_path(path).exists():
            try:
                found = load(path, run_id, max_update_bytes, round_open)
            except RecordError as err:
                remove(path)
                dropped(path, err.reason, str(err))
                continue
            org = found.record.organization
            if org in loaded:  # a replaced push whose files outlived its replacement: the newer record wins
                old, found = sorted((loaded[org], found), key=lambda f: record_path(f.part).stat().st_mtime_ns)
                os.close(old.fd)
                remove(old.part)
                dropped(old.part, "replaced", "another partial push of the organization is newer")
            loaded[org] = found
        elif path.suffix == ".part":
            remove(path)
            dropped(path, "unsynced", "no record: none of it was made durable")
        elif path.suffix == RECORD_SUFFIX and not path.with_suffix(".part").exists():
            remove(path.with_suffix(".part"))
            dropped(path.with_suffix(".part"), "torn", "its spool file is missing")
        elif path.suffix != RECORD_SUFFIX:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a record being written when the process ended, or a stranger
    return list(loaded.values())
