"""Named crash points of the client, for tests that kill it where a restart is hardest.

``HETFED_CLIENT_CRASH_AT=<point>[:<n>]`` in a client's environment makes the process kill itself with SIGKILL (no
cleanup, no flush) the ``n``-th time (default: the first) it reaches ``<point>``. Without the variable (always,
outside tests) a crash point costs one comparison.
"""

from __future__ import annotations

import os
import signal

# Where the client can be killed, in the order a round reaches them.
CRASH_POINTS: tuple[str, ...] = (
    "privacy.ledger_written",  # the round's releases and released values are on disk; the upload has not left
    "pending.update_written",  # the kept push's update is written and fsynced, its record not yet
    "push.half_sent",  # the push stream takes its middle chunk: about half the update is sent (a multi-chunk push)
    "secure.masked",  # secure aggregation: the keys are shared and the input masked; the masked input has not left
)


def _armed() -> tuple[str, int] | None:
    spec = os.environ.get("HETFED_CLIENT_CRASH_AT", "")
    if not spec:
        return None
    point, _, count = spec.partition(":")
    if point not in CRASH_POINTS:
        raise ValueError(f"HETFED_CLIENT_CRASH_AT names {point!r}, not one of {', '.join(CRASH_POINTS)}")
    return point, int(count or 1)


_ARMED = _armed()
_reached = 0


def armed(name: str) -> bool:
    """Whether ``HETFED_CLIENT_CRASH_AT`` names this point (a caller may then watch for it where it costs more)."""
    return _ARMED is not None and _ARMED[0] == name


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL when ``HETFED_CLIENT_CRASH_AT`` names this point (at its n-th visit)."""
    global _reached
    if _ARMED is None or _ARMED[0] != name:
        return
    _reached += 1
    if _reached >= _ARMED[1]:
        os.kill(os.getpid(), signal.SIGKILL)
