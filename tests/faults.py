"""A file layer for the run store that fails on demand (a full or failing disk), for tests and the harness.

``start_aggregator(config, disk=FaultyDisk())`` makes every run's store use it; ``add`` a ``DiskFault`` to
make matching operations fail (writing part of the data first, as a full disk does) and ``clear`` to let
space return. Crash points (killing the process) are in ``hetfed.aggregator.journal.crashpoints``.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hetfed.aggregator.journal.store import Disk


@dataclass
class DiskFault:
    """Make matching file operations of the store fail, as a full or failing disk would."""

    op: str  # "open", "pwrite", "fsync", "truncate" or "replace"
    file: str = ""  # a substring of the file's name ("updates.wal", "history.jsonl", "checkpoint.npz"); "": any
    error: int = errno.ENOSPC
    times: int = 1  # matching calls that fail; -1: every one until the fault is removed
    skip: int = 0  # matching calls let through first
    partial: float = 0.5  # pwrite: the fraction of the data written before the failure (a torn write)


class FaultyDisk(Disk):
    """The store's file layer with injectable failures (for tests and the fault harness)."""

    def __init__(self) -> None:
        self.faults: list[DiskFault] = []
        self.failed = 0
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, fault: DiskFault) -> DiskFault:
        """Start injecting ``fault``."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Stop injecting every fault (space returns)."""
        with self._lock:
            self.faults.clear()

    def _fault(self, op: str, name: str) -> DiskFault | None:
        with self._lock:
            for f in self.faults:
                if f.op == op and f.file in name and f.times != 0:
                    if f.skip > 0:
                        f.skip -= 1
                        return None
                    if f.times > 0:
                        f.times -= 1
                    self.failed += 1
                    return f
        return None

    @staticmethod
    def _raise(f: DiskFault, name: str) -> NoReturn:
        raise OSError(f.error, os.strerror(f.error), name)

    def open(self, path: Path) -> int:
        """Open, unless a fault says otherwise."""
        f = self._fault("open", path.name)
        if f is not None:
            self._raise(f, path.name)
        fd = super().open(path)
        self._names[fd] = path.name
        return fd

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        """Write, or write part and fail."""
        name = self._names.get(fd, "")
        f = self._fault("pwrite", name)
        if f is not None:
            view = memoryview(data).cast("B")
            super().pwrite(fd, view[: int(view.nbytes * f.partial)], offset)
            self._raise(f, name)
        super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        """fsync, unless a fault says otherwise."""
        name = self._names.get(fd, "")
        f = self._fault("fsync", name)
        if f is not None:
            self._raise(f, name)
        super().fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        """Truncate, unless a fault says otherwise."""
        name = self._names.get(fd, "")
        f = self._fault("truncate", name)
        if f is not None:
            self._raise(f, name)
        super().truncate(fd, size)

    def replace(self, src: Path, dst: Path) -> None:
        """Rename, unless a fault says otherwise."""
        f = self._fault("replace", dst.name)
        if f is not None:
            self._raise(f, dst.name)
        super().replace(src, dst)

    def close(self, fd: int) -> None:
        """Close."""
        self._names.pop(fd, None)
        super().close(fd)
