"""The state directory's file operations and failure types, shared by the journal's three files.

Every file operation goes through ``Disk`` (``DISK``), so tests and the fault harness can make any of them fail.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from hetfed.aggregator.journal.crashpoints import crash_point

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


@contextmanager
def mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """A file's bytes, memory-mapped (the log may be large)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            yield m


class _Appender:
    """A write-only file object that appends to a descriptor through ``Disk.pwrite`` (no seek: a zip written
    to it is streamed)."""

    def __init__(self, disk: Disk, fd: int) -> None:
        self._disk, self._fd, self._pos = disk, fd, 0

    def write(self, data: bytes | memoryview) -> int:
        n = memoryview(data).nbytes
        self._disk.pwrite(self._fd, data, self._pos)
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        """Not readable (numpy takes an object without ``read`` for a path)."""
        raise OSError("the file is open for writing only")

    def flush(self) -> None:
        """Nothing is buffered here."""


def atomic_write(disk: Disk, path: Path, data: bytes | memoryview | Callable[[BinaryIO], None],
                 checkpoint: bool) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves the old file or the new one; StorageError if not.
    ``data`` may be a function that writes the contents to the file object it is given, a piece at a time
    (nothing the size of the file is built in memory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = disk.open(tmp)
        try:
            disk.truncate(fd, 0)
            if callable(data):
                data(_Appender(disk, fd))  # type: ignore[arg-type]
            else:
                disk.pwrite(fd, data, 0)
            if checkpoint:
                crash_point("checkpoint.tmp_written")
            disk.fsync(fd)
            if checkpoint:
                crash_point("checkpoint.tmp_synced")
        finally:
            disk.close(fd)
        disk.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(f"could not write {path} ({exc.strerror or exc})") from None
    if checkpoint:
        crash_point("checkpoint.replaced")
    try:
        disk.fsync_dir(path.parent)
    except OSError as exc:  # the new file is in place; only its survival of a power loss is uncertain
        log.warning("%s: could not fsync the directory after replacing %s (%s)", path.parent, path.name,
                    exc.strerror or exc)
