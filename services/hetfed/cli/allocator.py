"""glibc's allocator tuned for processes that move large buffers every round.

An aggregator or client round allocates and frees buffers of megabytes (received chunks, reassembled
messages, decoded tensors, serialized instructions). glibc serves such blocks with fresh ``mmap`` pages and
gives them back to the kernel when freed, so every round pays a page fault per 4 KiB touched, often more
than the copy the buffer was made for: copying 4 MB into a fresh buffer took 0.77 ms here, into reused
memory 0.14 ms (``docs/benchmarks.md``, "The aggregator's hot path"). :func:`tune` fixes glibc's two
thresholds so that blocks up to 32 MiB come from the heap and up to 64 MiB of freed heap stays mapped for
the next round, and, for the aggregator, keeps every thread in one malloc arena.

The aggregator's one arena is so that freed memory can be handed back (``serving.memory.Trimmer``):
``malloc_trim`` releases the free top of the main arena but not that of another arena, where gRPC's threads
put the received bytes of the pushes. With two arenas, 8 to 34 MiB that stalled pushes had held in 4 and
16 MiB stream windows stayed resident after the trim (``tests/reliability/test_memory_release.py``).

It runs first thing in ``hetfed aggregator`` and ``hetfed client`` (the processes every deployment runs),
before any thread starts. Nothing happens where the C library is not glibc, where ``HETFED_ALLOCATOR=default``
is set, or where the operator already set glibc's own ``MALLOC_*`` variables: theirs win.
"""

from __future__ import annotations

import ctypes
import os

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 64 << 20
AGGREGATOR_ARENAS = 1  # see the module's docstring

_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_",
                    "GLIBC_TUNABLES")


def tune(arenas: int | None = None) -> dict[str, int]:
    """Set the thresholds (and ``arenas`` when given); returns what was set, empty when nothing was."""
    if os.environ.get("HETFED_ALLOCATOR", "tuned") == "default":
        return {}
    if any(v in os.environ for v in _GLIBC_VARIABLES):
        return {}
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    wanted = {"mmap_threshold": (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
              "trim_threshold": (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)}
    if arenas is not None:
        wanted["arena_max"] = (M_ARENA_MAX, arenas)
    return {name: value for name, (param, value) in wanted.items() if mallopt(param, value) == 1}
