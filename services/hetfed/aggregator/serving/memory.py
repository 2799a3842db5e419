"""Returning a refused push's memory to the system: glibc's ``malloc_trim`` soon after the push ends.

A refused, stalled or cancelled push leaves freed memory behind in the allocator: its 1 MiB chunks and gRPC's
receive buffers come from the heap (``hetfed.cli.allocator`` serves blocks up to 32 MiB there and keeps up to
64 MiB of free heap mapped, so that the next round reuses it). For a push that completed that is the point;
for a refused one it is memory an attacker made the aggregator keep, so the free pages are handed back.
``malloc_trim`` hands back the free pages of every arena, but the free top of the main arena only: the
aggregator runs in one arena (``hetfed.cli.allocator``), else what gRPC's threads freed stays resident.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hetfed.aggregator")

# Seconds between a refused push's end and the trim (gRPC frees its buffers of the call once its status is
# sent), and the least time between two trims.
TRIM_DELAY_SECONDS = 0.3
TRIM_INTERVAL_SECONDS = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: nothing to trim this way
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


class Trimmer:
    """Trims the allocator's free memory in a thread of its own after ``request``: one trim per burst of
    requests, ``delay`` after the burst's last request (or ``interval`` after its first, whichever is sooner),
    and one more after a request that came while a trim was under way or was cut short."""

    def __init__(self, delay: float = TRIM_DELAY_SECONDS, interval: float = TRIM_INTERVAL_SECONDS) -> None:
        self.delay = delay
        self.interval = interval
        self.trims = 0
        self._trim = _malloc_trim()
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        """Ask for a trim soon (cheap, callable from the event loop)."""
        if self._trim is None:
            return
        self._wanted.set()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hetfed-trim", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        assert self._trim is not None
        while True:
            self._wanted.wait()
            self._wanted.clear()
            # Let the latest push's buffers be freed first: wait until `delay` passes without a new request
            # (each one restarts it), but at most `interval` in all, so that a stream of requests still trims.
            first = time.monotonic()
            while self._wanted.wait(self.delay):
                self._wanted.clear()
                if time.monotonic() - first >= self.interval:
                    self._wanted.set()  # a request is still owed a trim after this one
                    break
            self._trim(0)
            self.trims += 1
            threading.Event().wait(self.interval)
