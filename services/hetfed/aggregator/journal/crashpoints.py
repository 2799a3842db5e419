"""Named crash points on the aggregator's write path, for the fault-injection harness.

``HETFED_CRASH_AT=<point>[:<n>]`` in the aggregator's environment makes the process end abruptly
(``os._exit``: no cleanup, no flush, like SIGKILL) the ``n``-th time (default: the first) it reaches
``<point>``. Without the variable (always, outside the harness) a crash point costs one comparison.
``benchmarks/faults.py`` kills the aggregator at every point below but ``spool.*`` (only a cut push reaches
those; ``tests/wire/test_durable_spool.py`` kills it there) and ``stages.*`` (only a secure round reaches those;
``tests/e2e/test_secure_restart.py`` kills it there), and checks that every restart succeeds and that no
acknowledged update is lost.

``HETFED_DELAY_AT=<point>:<seconds>`` makes every visit of ``<point>`` wait that long first, as a slow disk
would (the harness uses it at ``wal.syncing`` so that concurrent pushes pile up behind one fsync and share
the next: a group commit it can kill).
"""

from __future__ import annotations

import math
import os
import time

# Where the write path can be interrupted, in the order a push and a round close reach them.
CRASH_POINTS: tuple[str, ...] = (
    "wal.header_written",  # an update's record header is written, its data not yet
    "wal.data_written",  # the whole record is written, not yet fsync'd
    "wal.syncing",  # an fsync covering every record written so far is about to start (outside the run's lock)
    "wal.synced",  # the record is durable; the push is not yet acknowledged
    "push.acknowledged",  # the reply is built (the process dies before or while sending it)
    "close.folding",  # a close has folded a range of elements of the round's updates (nothing of it is durable)
    "history.written",  # a closing round's history line is written, not yet fsync'd
    "history.synced",  # the history line is durable; the checkpoint that counts it is not written
    "checkpoint.tmp_written",  # the new checkpoint is in its temporary file, not yet fsync'd
    "checkpoint.tmp_synced",  # the temporary file is durable, not yet renamed over checkpoint.npz
    "checkpoint.replaced",  # checkpoint.npz is the new one; the directory is not yet fsync'd
    "wal.truncated",  # the closed round's records are cut from the log
    "stages.appended",  # a secure round's stage message or close is durable in secure.log, not yet answered
    "spool.synced",  # a partial push's spool file is fsync'd, its new record not yet renamed over the old one
)
EXIT_CODE = 86


def _spec(variable: str) -> tuple[str, str] | None:
    """``(point, argument)`` of ``<point>[:<argument>]`` in the environment variable, the point checked."""
    spec = os.environ.get(variable, "")
    if not spec:
        return None
    point, _, argument = spec.partition(":")
    if point not in CRASH_POINTS:
        raise ValueError(f"{variable} names {point!r}, not one of {', '.join(CRASH_POINTS)}")
    return point, argument


def _armed() -> tuple[str, int] | None:
    spec = _spec("HETFED_CRASH_AT")
    return None if spec is None else (spec[0], int(spec[1] or 1))


def _delay() -> tuple[str, float] | None:
    spec = _spec("HETFED_DELAY_AT")
    if spec is None:
        return None
    delay = float(spec[1] or "nan")
    if not (math.isfinite(delay) and 0 < delay <= 60):
        raise ValueError(f"HETFED_DELAY_AT: the delay must be in (0, 60] seconds, got {spec[1]!r}")
    return spec[0], delay


_ARMED = _armed()
_DELAY = _delay()
_reached = 0


def crash_point(name: str) -> None:
    """End the process here when ``HETFED_CRASH_AT`` names this point (and this is its n-th visit)."""
    global _reached
    if _DELAY is not None and _DELAY[0] == name:
        time.sleep(_DELAY[1])
    if _ARMED is None or _ARMED[0] != name:
        return
    _reached += 1
    if _reached >= _ARMED[1]:
        os._exit(EXIT_CODE)
