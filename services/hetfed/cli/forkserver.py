"""A fork server for local federations: import torch and the client runtime once, fork each client process.

Starting a client process costs seconds (importing torch, the client runtime, loading the built-in data set)
and a local federation starts one per organization and run. The fork server is one process that imports all
of that, loads the data once (the data package caches the raw data sets), freezes its heap (so the children's
pages stay shared) and then forks a child per request; each child redirects its output to its own log,
changes to its directory and environment, and runs exactly ``hetfed client --config FILE``, the same entry
point a deployment runs. The fork server never creates a gRPC channel or server and runs no torch operation,
so no gRPC state or thread pool exists when it forks: every child initialises gRPC itself.

It is single-threaded: requests come as JSON lines on its stdin, and SIGCHLD wakes the same loop through a
self-pipe; every reply (a child's pid, a child's exit status) is a JSON line on its stdout. The orchestrator's
side is :class:`ForkServer`, whose :class:`ForkedProcess` handles offer what ``subprocess.Popen`` offers for
watching and stopping a process.

Besides ``hetfed client``, it is the one module of the CLI that imports client code beyond the catalog
(``hetfed.client.catalog``): its server side preloads the client runtime for the children. An import contract
in pyproject.toml names this exception.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# ================================================================================================ the server


def _child(argv: list[str], log: str, cwd: str, env: Mapping[str, str], inherited: Sequence[int]) -> None:
    """In a fresh fork: become ``hetfed ARGV`` with its own log, directory and environment, then exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # replaces the server's request pipe
        os.dup2(out, 1)  # replaces the server's reply pipe
        os.dup2(out, 2)
        for fd in {*inherited, out, null} - {0, 1, 2}:
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        import logging

        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        gc.unfreeze()
        from hetfed.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _preload(warm: Sequence[Mapping[str, Any]]) -> None:
    """Import what every client needs and load the data sets they will read (cached in this process)."""
    # torch, shared with every child, and torch._dynamo, which each optimizer's constructor imports (1.5 s in
    # every child otherwise).
    import torch._dynamo  # noqa: F401

    import hetfed.client.algorithms
    import hetfed.client.artifacts
    import hetfed.client.runtime  # noqa: F401
    from hetfed.client.data import DataConfig, load_client_data

    for cfg in warm:
        load_client_data(DataConfig(**cfg))  # fills the data package's caches of the raw data sets


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """The fork server's loop: spawn requests on ``stdin``, pids and exit statuses on ``stdout``."""
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    signal.signal(signal.SIGTERM, lambda *_: None)
    inp, out = stdin.fileno(), stdout.fileno()

    def reply(message: dict[str, Any]) -> None:
        os.write(out, (json.dumps(message) + "\n").encode())

    pending = b""
    poller = select.poll()
    poller.register(inp, select.POLLIN | select.POLLHUP)
    poller.register(rfd, select.POLLIN)
    while True:
        events = poller.poll()
        for fd, _ in events:
            if fd == rfd:
                os.read(rfd, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data = os.read(inp, 1 << 16)
            if not data:
                return 0  # the orchestrator went away; it stops the children it started
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if request["op"] == "warm":
                    _preload(request["data"])
                    gc.collect()
                    gc.freeze()  # shared, copy-on-write pages stay shared in every child
                    reply({"warm": True})
                elif request["op"] == "spawn":
                    pid = os.fork()
                    if pid == 0:
                        _child(request["argv"], request["log"], request["cwd"], request["env"], (inp, out, rfd, wfd))
                    reply({"id": request["id"], "pid": pid})


# ================================================================================================ the client


class ForkedProcess:
    """A process the fork server started: ``poll``, ``wait``, ``terminate`` and ``kill`` as on ``Popen``."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while self.poll() is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                if not self._server.alive():
                    raise RuntimeError("the fork server stopped before its child exited")
                self._server.changed.wait(0.5 if remaining is None else min(0.5, remaining))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process has exited."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The orchestrator's handle on a fork server process."""

    def __init__(self, env: Mapping[str, str], log: Path, warm: Sequence[Mapping[str, Any]] = ()) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - owned for the server's lifetime
        self._proc = subprocess.Popen([sys.executable, "-m", "hetfed.cli.forkserver"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=dict(env))
        self.changed = threading.Condition()
        self._pids: dict[str, int] = {}
        self._exits: dict[int, int] = {}
        self._warm = False
        self._reader = threading.Thread(target=self._read, name="hetfed-forkserver", daemon=True)
        self._reader.start()
        self._send({"op": "warm", "data": list(warm)})

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        self._proc.stdin.flush()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                elif "pid" in message:
                    self._pids[message["id"]] = int(message["pid"])
                elif "warm" in message:
                    self._warm = True
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        """Whether the fork server process still runs."""
        return self._proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        """A child's exit status, once it has exited."""
        with self.changed:
            return self._exits.get(pid)

    def spawn(self, name: str, argv: list[str], log: Path, cwd: Path, env: Mapping[str, str],
              timeout: float = 300.0) -> ForkedProcess:
        """Fork a child running ``hetfed ARGV``; returns once its pid is known."""
        self._send({"op": "spawn", "id": name, "argv": argv, "log": str(log), "cwd": str(cwd), "env": dict(env)})
        deadline = time.monotonic() + timeout
        with self.changed:
            while name not in self._pids:
                if not self.alive():
                    raise RuntimeError(f"the fork server exited with {self._proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fork server did not start {name} within {timeout}s")
                self.changed.wait(0.5)
            return ForkedProcess(self, self._pids.pop(name), ["hetfed", *argv])

    def close(self) -> None:
        """Stop the fork server (its children are stopped by whoever started them)."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


if __name__ == "__main__":
    sys.exit(serve(sys.stdin.buffer, sys.stdout.buffer))
