"""A link on loopback: a TCP relay that adds a round-trip time and, optionally, a bandwidth cap.

    relay = LinkRelay(("127.0.0.1", port), rtt_ms=100, mbit=1000)
    relay_port = relay.start()      # connect here instead of to port
    ...
    relay.stop()

Every connection made to the relay is forwarded to ``target`` on a connection of its own. In each direction
every byte is held for half the round trip (propagation), after it has been serialized at ``mbit`` megabits
per second when ``mbit`` > 0 (the link's bandwidth: departures are spaced by each piece's size over the rate,
shared by all the relay's connections in that direction). What the relay holds in one direction is bounded
like a real link's: the bytes on the wire (bandwidth x one-way delay) plus a queue of one round trip at the
rate (at least 1 MiB). Past that it stops reading, and the sender's TCP waits. Without a bandwidth cap the
link is as fast as this machine relays bytes, and holds at most ``UNCAPPED_INFLIGHT_BYTES`` each way.

A stream through the relay with TCP alone (a plain socket sender, a plain socket sink) is the floor any
protocol on the same link is measured against: benchmarks/window_throughput.py. Benchmarks import it as
``from linkrelay import LinkRelay``; tests as ``tests.conftest.load_benchmark("linkrelay")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque

READ_BYTES = 64 << 10
UNCAPPED_INFLIGHT_BYTES = 64 << 20
MIN_QUEUE_BYTES = 1 << 20


class _Direction:
    """One direction of the link: its serialization clock, and what it relayed."""

    def __init__(self, rate_bytes_per_s: float, delay_s: float) -> None:
        self.rate, self.delay = rate_bytes_per_s, delay_s
        self.free_at = 0.0  # when the link finishes serializing what it was given so far
        self.bytes = 0
        if rate_bytes_per_s > 0:
            self.capacity = int(rate_bytes_per_s * delay_s + max(rate_bytes_per_s * 2 * delay_s, MIN_QUEUE_BYTES))
        else:
            self.capacity = UNCAPPED_INFLIGHT_BYTES

    def due(self, size: int) -> float:
        """When ``size`` bytes read now reach the far end."""
        now = time.monotonic()
        if self.rate <= 0:
            return now + self.delay
        self.free_at = max(now, self.free_at) + size / self.rate
        return self.free_at + self.delay


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Direction) -> None:
    """Copy ``reader`` to ``writer`` through ``link``: in order, each piece at its due time, at most
    ``link.capacity`` bytes held; the end of the stream is passed on after the last byte."""
    queue: deque[tuple[float, bytes]] = deque()
    held = 0
    changed = asyncio.Event()
    done = False

    async def read() -> None:
        nonlocal done, held
        try:
            while data := await reader.read(READ_BYTES):
                while held >= link.capacity:
                    changed.clear()
                    await changed.wait()
                queue.append((link.due(len(data)), data))
                held += len(data)
                changed.set()
        except ConnectionError:
            pass
        done = True
        changed.set()

    task = asyncio.ensure_future(read())
    try:
        while True:
            while not queue:
                if done:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                changed.clear()
                await changed.wait()
            due, data = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            # Counted as it is handed to the socket: the peer may read it before drain() returns.
            link.bytes += len(data)
            writer.write(data)
            await writer.drain()
            held -= len(data)
            changed.set()
    except ConnectionError:
        pass
    finally:
        task.cancel()


class LinkRelay:
    """A relay on 127.0.0.1 to ``target`` that adds ``rtt_ms`` of round trip and, if ``mbit`` > 0, caps each
    direction's bandwidth at ``mbit`` megabits per second. It runs in a thread with its own event loop."""

    def __init__(self, target: tuple[str, int], rtt_ms: float = 0.0, mbit: float = 0.0) -> None:
        if rtt_ms < 0 or mbit < 0:
            raise ValueError(f"rtt_ms and mbit must be >= 0 (got {rtt_ms}, {mbit})")
        self.target, self.rtt_ms, self.mbit = target, rtt_ms, mbit
        rate = mbit * 1e6 / 8
        self._up, self._down = _Direction(rate, rtt_ms / 2e3), _Direction(rate, rtt_ms / 2e3)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def bytes_up(self) -> int:
        """Bytes forwarded from the clients to the target so far."""
        return self._up.bytes

    @property
    def bytes_down(self) -> int:
        """Bytes forwarded from the target to the clients so far."""
        return self._down.bytes

    def start(self) -> int:
        """Listen on 127.0.0.1 (a free port) and return the port."""
        if self._loop is not None:
            raise RuntimeError("the relay is already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-relay", daemon=True)
        self._thread.start()

        async def listen() -> int:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            return int(self._server.sockets[0].getsockname()[1])

        self.port = asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)
        return self.port

    def stop(self) -> None:
        """Stop listening, close every relayed connection and end the relay's thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self._loop = self._thread = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, t_writer))
        for w in (writer, t_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(_pipe(reader, t_writer, self._up), _pipe(t_reader, writer, self._down))
        finally:
            for w in (writer, t_writer):
                self._writers.discard(w)
                w.close()
