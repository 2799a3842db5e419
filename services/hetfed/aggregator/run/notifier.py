"""The ``ChangeNotifier``: long-polls waiting in asyncio event loops, woken from any thread when a run's state
changes."""

from __future__ import annotations

import asyncio
import contextlib
import threading

# Long-polls woken per event-loop iteration when a run changes (see ``ChangeNotifier.notify``).
WAKE_BATCH = 32


class ChangeNotifier:
    """Wakes long-polls waiting in an asyncio event loop, from any thread, when a run's state changes.

    A waiter costs a future, not a thread; a cancelled wait (the client gave up) removes itself at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    @property
    def waiting(self) -> int:
        """How many long-polls wait now."""
        return len(self._waiters)

    def notify(self) -> None:
        """Wake every waiter (callable from any thread).

        Waiters are woken ``WAKE_BATCH`` per event-loop iteration, not all at once: a thousand long-polls woken
        in one iteration would run their next steps back to back while health checks, pushes and Status
        calls that arrived meanwhile wait behind all of them."""
        with self._lock:
            self.version += 1
            waiters, self._waiters = self._waiters, set()
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for loop, fut in waiters:
            by_loop.setdefault(loop, []).append(fut)
        for loop, futs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its waiters are gone
                loop.call_soon_threadsafe(_wake_batches, futs)

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once the version is no longer ``seen``, or after ``timeout`` seconds; cancellable."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        with self._lock:
            if self.version != seen:
                return
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(entry[1], timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(entry)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake_batches(futs: list[asyncio.Future[None]]) -> None:
    """Wake the first ``WAKE_BATCH`` of ``futs`` now and the rest in later iterations (on the loop)."""
    for fut in futs[:WAKE_BATCH]:
        _wake(fut)
    if len(futs) > WAKE_BATCH:
        asyncio.get_running_loop().call_soon(_wake_batches, futs[WAKE_BATCH:])
