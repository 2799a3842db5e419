"""Resident pages of read-only file mappings, given back after each block of a pass over them.

A received push of 64 MiB or more is a read-only memory map of its spool file, and the write-ahead log is read
through one. Reading a mapping makes its pages resident in the process (``RssFile``, counted in its peak); a pass
over a whole update would hold all of it. The passes (the finiteness check, the norms, the write into the log, the
close's fold) take a block at a time and call ``drop_pages`` on it: the bytes stay in the file and the page cache
and come back on the next read, and the process's resident memory falls back by the block.
"""

from __future__ import annotations

import mmap

import numpy as np

# Bytes a pass over a mapped update takes between two drops: about what it keeps resident.
BLOCK_BYTES = 16 << 20


def drop_pages(a: np.ndarray | memoryview) -> None:
    """Give the pages that ``a`` views back to the kernel when they belong to a read-only file mapping: the bytes
    stay in the file and the page cache, and come back on the next read; the process's resident memory drops.
    Partial pages at either end are kept. Any other buffer (anonymous memory, where ``MADV_DONTNEED`` would zero
    the values, or a writable mapping) is left alone."""
    if isinstance(a, memoryview):
        if not a.nbytes:
            return
        a = np.frombuffer(a.cast("B") if a.c_contiguous else a, np.uint8)
    base: object = a
    while isinstance(base, np.ndarray):
        base = base.base
    if not (isinstance(base, memoryview) and base.readonly and isinstance(base.obj, mmap.mmap)):
        return
    mapping = base.obj
    if mapping.closed or not a.flags.c_contiguous or not a.nbytes:
        return
    start = a.ctypes.data - np.frombuffer(mapping, np.uint8, count=1).ctypes.data
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
