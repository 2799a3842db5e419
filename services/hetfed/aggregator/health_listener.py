"""A plaintext listener that serves only the gRPC health service, for the kubelet's probes.

Under mTLS the aggregator's gRPC port requires a client certificate, and the kubelet's built-in gRPC
probe presents none. This second listener carries nothing but the health service: no run, no status, no
payload.

It runs on an event loop and a thread of its own, so a probe is answered in milliseconds even while the
loop that serves the clients works through a burst (a thousand long-polls woken at a round's close, a
thousand pushes streaming in), where a check on that loop waits its turn for up to a second. Answering from
another thread must not hide a dead serving loop, so the answer is tied to it twice:

- its statuses mirror the serving loop's ``Health`` (NOT_SERVING as soon as a graceful stop begins);
- a heartbeat task on the serving loop stamps the time every ``HEARTBEAT_SECONDS``; when the last stamp is
  older than ``stall_seconds`` (``server.health_stall_seconds``) every service answers NOT_SERVING until the
  loop beats again, so a wedged or starved serving loop fails the liveness probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import grpc.aio

from hetfed.wire.transport import Health, make_server

HEARTBEAT_SECONDS = 0.25


class LoopHeartbeat:
    """The serving loop's pulse: ``beat()`` runs on that loop; ``alive()`` may be read from any thread."""

    def __init__(self, stall_seconds: float) -> None:
        if not (math.isfinite(stall_seconds) and stall_seconds > 0):
            raise ValueError(f"stall_seconds must be a positive number, got {stall_seconds!r}")
        self.stall_seconds = stall_seconds
        self._last = time.monotonic()

    async def beat(self, interval: float = HEARTBEAT_SECONDS) -> None:
        """Stamp the time every ``interval`` seconds until cancelled."""
        while True:
            self._last = time.monotonic()
            await asyncio.sleep(interval)

    def age(self) -> float:
        """Seconds since the serving loop last ran its heartbeat."""
        return time.monotonic() - self._last

    def alive(self) -> bool:
        """Whether the serving loop beat within ``stall_seconds``."""
        return self.age() <= self.stall_seconds


class HealthListener:
    """The health service on ``address``, served from its own thread and event loop.

    ``mirror`` (registered on the serving ``Health``'s ``on_change``) copies statuses across threads;
    ``alive`` is the serving loop's heartbeat verdict.
    """

    def __init__(self, address: str, alive: LoopHeartbeat) -> None:
        self._address = address
        self._heartbeat = alive
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hetfed-health", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.health = Health(alive.alive)
        self.port = -1

    def start(self) -> None:
        """Bind and serve; raises ``OSError`` when the address cannot be bound."""
        self._thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._boot(), self._loop).result(timeout=30)
        except BaseException:
            self._close_loop()
            raise

    async def _boot(self) -> int:
        server, port = make_server(self._address, None)
        server.add_generic_rpc_handlers((self.health.generic_handler(),))
        await server.start()
        self._server = server
        self._watcher = asyncio.create_task(self._watch_heartbeat())
        return port

    async def _watch_heartbeat(self) -> None:
        """Wake Watch streams whenever the heartbeat verdict flips."""
        last = True
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            now = self._heartbeat.alive()
            if now != last:
                self.health.wake_watchers()
                last = now

    def mirror(self, statuses: dict[str, int], shutting_down: bool) -> None:
        """Copy the serving ``Health``'s state (callable from any thread)."""
        self.health.adopt(statuses, shutting_down)  # seen by the next check at once
        with contextlib.suppress(RuntimeError):  # a stopped listener has nobody watching
            self._loop.call_soon_threadsafe(self.health.wake_watchers)

    def stop(self) -> None:
        """Stop serving (at once: probes carry nothing to drain)."""
        if self._loop.is_closed():
            return
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._close_loop()

    async def _shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        assert self._server is not None
        await self._server.stop(0)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()
