"""A plaintext listener that serves only the gRPC health service, for the kubelet's probes.

Under mTLS the aggregator's gRPC port requires a client certificate, and the kubelet's built-in gRPC
probe presents none. This second listener carries nothing but the health service: no run, no status, no
payload.

It is a small process of its own (``python -m hetfed.aggregator.serving.health_listener``, started and stopped by the
aggregator), so a probe is answered in milliseconds even while the aggregator's event loop works through a
burst (a thousand long-polls woken at a round's close, a thousand pushes streaming in) and its threads
contend for one interpreter lock: a check on the serving port can then wait for a second. Answering from
elsewhere must not hide a dead aggregator, so the answer is tied to it through 16 bytes of shared memory:

- the aggregator's health state (SERVING, or NOT_SERVING from the moment a graceful stop begins);
- a heartbeat that a task on the aggregator's serving event loop stamps every ``HEARTBEAT_SECONDS``: once
  the last stamp is older than ``stall_seconds`` (``server.health_stall_seconds``) every service answers
  NOT_SERVING until the loop beats again, so a wedged or starved aggregator fails its liveness probe.

The listener exits when the aggregator stops it, or by itself within ``HEARTBEAT_SECONDS`` once its parent
has gone (a SIGKILLed aggregator leaves no listener behind).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from hetfed.wire.rpc import SERVICE_NAME
from hetfed.wire.transport import Health, make_server

HEARTBEAT_SECONDS = 0.25
# The shared page: the serving loop's last heartbeat (time.monotonic(), the same clock in every process of
# the machine) and the aggregator's state.
_LAYOUT = struct.Struct("<dI4x")
STARTING, SERVING, STOPPING = 0, 1, 2
_SERVICES = ("", SERVICE_NAME)


class SharedHealth:
    """The 16 shared bytes, one writer (the aggregator) and one reader (the listener)."""

    def __init__(self, path: Path, writable: bool) -> None:
        self.path = path
        with open(path, "r+b" if writable else "rb") as f:
            self._map = mmap.mmap(f.fileno(), _LAYOUT.size,
                                  access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)

    @classmethod
    def create(cls) -> SharedHealth:
        """A new page in a temporary file (in memory where /dev/shm exists), stamped now, state STARTING."""
        try:  # /dev/shm where it is writable (a read-only root filesystem keeps it), else the temp directory
            fd, name = tempfile.mkstemp(prefix="hetfed-health-", dir="/dev/shm")
        except OSError:
            fd, name = tempfile.mkstemp(prefix="hetfed-health-")
        with os.fdopen(fd, "wb") as f:
            f.write(_LAYOUT.pack(time.monotonic(), STARTING))
        return cls(Path(name), writable=True)

    def read(self) -> tuple[float, int]:
        """(last heartbeat, state); read until two reads agree, so a write in progress is never seen torn."""
        while True:
            first = self._map[: _LAYOUT.size]
            if first == self._map[: _LAYOUT.size]:
                beat, state = _LAYOUT.unpack(first)
                return beat, state

    def beat(self) -> None:
        """Stamp the heartbeat now."""
        self._map[:8] = struct.pack("<d", time.monotonic())

    def set_state(self, state: int) -> None:
        """Publish the aggregator's state."""
        self._map[8:12] = struct.pack("<I", state)

    def close(self, unlink: bool = False) -> None:
        """Unmap (and remove the file)."""
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class LoopHeartbeat:
    """The serving loop's pulse: ``beat()`` runs as a task on that loop and stamps the shared page."""

    def __init__(self, shared: SharedHealth) -> None:
        self.shared = shared

    async def beat(self, interval: float = HEARTBEAT_SECONDS) -> None:
        """Stamp the time every ``interval`` seconds until cancelled."""
        while True:
            self.shared.beat()
            await asyncio.sleep(interval)


class HealthListener:
    """The aggregator's side: starts the listener process, publishes its health state, stops the process."""

    def __init__(self, address: str, stall_seconds: float) -> None:
        if not (math.isfinite(stall_seconds) and stall_seconds > 0):
            raise ValueError(f"stall_seconds must be a positive number, got {stall_seconds!r}")
        self.shared = SharedHealth.create()
        self.heartbeat = LoopHeartbeat(self.shared)
        self._address = address
        self._stall = stall_seconds
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = -1

    def start(self, timeout: float = 30.0) -> None:
        """Start the listener process; returns once it serves. Raises ``OSError`` (with the listener's words)
        when it cannot bind or does not come up in ``timeout`` seconds."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hetfed.aggregator.serving.health_listener", "--listen", self._address,
             "--shared", str(self.shared.path), "--stall-seconds", repr(self._stall), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)  # its stderr is the aggregator's
        assert self._proc.stdout is not None
        line = _read_line(self._proc.stdout, timeout)
        if not line.startswith(b"serving "):
            self.stop()
            raise OSError(f"the health listener on {self._address} did not start: "
                          f"{line.decode(errors='replace').strip() or 'no answer'}")
        self.port = int(line.split()[1])

    def mirror(self, statuses: dict[str, int], shutting_down: bool) -> None:
        """Publish the serving ``Health``'s state (registered on its ``on_change``; any thread)."""
        if shutting_down:
            state = STOPPING
        elif statuses.get(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING:
            state = SERVING
        else:
            state = STARTING
        self.shared.set_state(state)

    def stop(self) -> None:
        """Stop the listener process (SIGTERM, then SIGKILL after 5 s) and remove the shared page."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        with contextlib.suppress(ValueError):  # already closed
            self.shared.close(unlink=True)


def _read_line(pipe: object, timeout: float) -> bytes:
    """The first line the listener prints, or b"" when it exits or stays silent for ``timeout`` seconds."""
    import selectors

    fileno = pipe.fileno()  # type: ignore[attr-defined]
    with selectors.DefaultSelector() as sel:
        sel.register(fileno, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return buf
            chunk = os.read(fileno, 4096)
            if not chunk:
                return buf
            buf += chunk
        return buf


# ============================================================================================ the process


class _ProbeHealth(Health):
    """The health service answered from the shared page."""

    def __init__(self, shared: SharedHealth, stall_seconds: float) -> None:
        super().__init__()
        self._shared = shared
        self._stall = stall_seconds

    def verdict(self) -> int:
        """SERVING while the aggregator says so and its serving loop beat within the stall bound."""
        beat, state = self._shared.read()
        alive = time.monotonic() - beat <= self._stall
        return health_pb2.HealthCheckResponse.SERVING if state == SERVING and alive else \
            health_pb2.HealthCheckResponse.NOT_SERVING

    def status(self, service: str) -> int | None:
        return self.verdict() if service in _SERVICES else None


async def _serve(address: str, shared: SharedHealth, stall_seconds: float, parent: int) -> None:
    health = _ProbeHealth(shared, stall_seconds)
    server, port = make_server(address, None)
    server.add_generic_rpc_handlers((health.generic_handler(),))
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving {port}", flush=True)
    last = health.verdict()
    while not stop.is_set():
        if os.getppid() != parent:  # the aggregator is gone (killed): so is its health
            break
        now = health.verdict()
        if now != last:  # let Watch streams see the change
            health.wake_watchers()
            last = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HEARTBEAT_SECONDS)
    await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    """The listener process (started by the aggregator)."""
    p = argparse.ArgumentParser(description="hetfed aggregator's plaintext health listener (started by it)")
    p.add_argument("--listen", required=True)
    p.add_argument("--shared", type=Path, required=True)
    p.add_argument("--stall-seconds", type=float, required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    shared = SharedHealth(args.shared, writable=False)
    try:
        asyncio.run(_serve(args.listen, shared, args.stall_seconds, args.parent))
    except (OSError, RuntimeError) as exc:  # grpcio reports a port it cannot bind either way
        print(f"cannot serve on {args.listen}: {exc}", flush=True)
        return 1
    finally:
        shared.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
