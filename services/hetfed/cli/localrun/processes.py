"""The processes of a local federation: an aggregator and its clients started, watched and stopped.

Nothing is simulated: each is a separate process started with the same ``hetfed aggregator`` / ``hetfed
client`` commands a Kubernetes deployment runs, talking gRPC on loopback. Under ``--metrics-linger`` every
client also serves /metrics on a loopback port listed in a Prometheus targets file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetfed.cli import PRIVACY_BUDGET_SPENT
from hetfed.cli.forkserver import ForkedProcess, ForkServer
from hetfed.cli.localrun.planning import LocalRunOptions
from hetfed.wire.messages import RunStatus
from hetfed.wire.rpc import status_of
from hetfed.wire.transport import TlsConfig

# Where the aggregator listens and serves its metrics in a local federation: loopback, on ports it picks.
LOOPBACK = "127.0.0.1"


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


# Every federation this process has started and not yet stopped: a SIGTERM to `hetfed run` or `hetfed bench`
# stops them all (``stop_all``), so no aggregator or client process outlives its orchestrator.
_LIVE: weakref.WeakSet[LocalFederation] = weakref.WeakSet()
_STOPPING = threading.Event()


def stop_all() -> None:
    """Stop every federation this process started that is still running, and refuse new ones (the CLI's
    SIGTERM handler)."""
    _STOPPING.set()
    for fed in list(_LIVE):
        fed.stop()


class FederationFailedError(RuntimeError):
    """A process of a local federation exited with an error while its run was in progress. The message names
    the process and ends with the last lines of its log; ``hetfed run`` and ``hetfed bench`` print it as their
    error, without a traceback of their own."""


class LocalFederation:
    """Starts, watches and stops an aggregator process and its client processes.

    Client processes are forked from a fork server (``hetfed.cli.forkserver``) that imported torch and the
    client runtime once, when ``fork_clients`` (the default where the OS can fork); each one then runs the
    same ``hetfed client --config FILE`` a deployment runs. ``warm`` lists data configs whose data sets the
    fork server loads once for all its children.
    """

    def __init__(self, workdir: Path, tls: TlsConfig | None = None, fork_clients: bool = True,
                 warm: Sequence[Mapping[str, Any]] = ()) -> None:
        self.workdir = workdir
        # The orchestrator's client certificate when the aggregator requires mTLS.
        self.tls = tls
        self.env = _subprocess_env()
        self.aggregator: subprocess.Popen[bytes] | None = None
        self.clients: dict[str, subprocess.Popen[bytes] | ForkedProcess] = {}
        self.port = 0
        self.metrics_port = -1
        self._forks: ForkServer | None = None
        if _STOPPING.is_set():
            raise RuntimeError("this process is stopping (SIGTERM): no new federation is started")
        _LIVE.add(self)
        if fork_clients and hasattr(os, "fork"):
            # Started first, so its imports overlap with the aggregator's start.
            self._forks = ForkServer(self.env, workdir / "forkserver.log", warm)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child process
        return subprocess.Popen([sys.executable, "-m", "hetfed.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.workdir)

    def start_aggregator(self, config: dict[str, Any], timeout: float = 60.0) -> None:
        """Write the config, start the aggregator and wait until it reports its port."""
        path = self.workdir / "aggregator.json"
        path.write_text(json.dumps(config, indent=2))
        ready = self.workdir / "aggregator.ready"
        ready.unlink(missing_ok=True)
        self.aggregator = self._spawn("aggregator", ["aggregator", "--config", str(path), "--ready-file", str(ready)])
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.aggregator.poll() is not None:
                raise FederationFailedError(f"the aggregator exited with {self.aggregator.returncode}:\n"
                                            f"{self.log_tail('aggregator')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the aggregator did not start within {timeout}s")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.metrics_port = int(info["port"]), int(info["metrics_port"])

    def start_client(self, name: str, config: dict[str, Any]) -> None:
        """Write a client config and start that organization's process (forked when a fork server runs)."""
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(config, indent=2))
        argv = ["client", "--config", str(path)]
        if self._forks is not None:
            self.clients[name] = self._forks.spawn(name, argv, self.workdir / f"{name}.log", self.workdir, self.env)
        else:
            self.clients[name] = self._spawn(name, argv)

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of a process's log."""
        p = self.workdir / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""

    def failed_client(self) -> str | None:
        """The name of a client process that exited with an error, if any (leaving a run because its privacy
        budget is spent is no error)."""
        for name, proc in self.clients.items():
            if proc.poll() not in (None, 0, PRIVACY_BUDGET_SPENT):
                return name
        return None

    def left_clients(self) -> list[str]:
        """The client processes that left their run because their organization's privacy budget is spent."""
        return [name for name, proc in self.clients.items() if proc.poll() == PRIVACY_BUDGET_SPENT]

    def exited(self, name: str) -> bool:
        """Whether a client process has exited."""
        return self.clients[name].poll() is not None

    def raise_if_failed(self) -> None:
        """Raise with the log's tail if a client failed or the aggregator exited while a run is in progress."""
        bad = self.failed_client()
        if bad:
            raise FederationFailedError(f"{bad} failed:\n{self.log_tail(bad)}")
        if self.aggregator is not None and self.aggregator.poll() is not None:
            raise FederationFailedError(f"the aggregator exited:\n{self.log_tail('aggregator')}")

    def status(self, timeout: float = 10.0) -> list[RunStatus]:
        """The aggregator's Status of every run."""
        return status_of(f"{LOOPBACK}:{self.port}", self.tls, timeout=timeout)

    def wait_clients(self, timeout: float) -> None:
        """Wait for every client process to exit."""
        deadline = time.monotonic() + timeout
        for proc in self.clients.values():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def stop(self) -> None:
        """Terminate everything still running (gracefully, then by force), then the fork server."""
        _LIVE.discard(self)
        procs = [*self.clients.values(), *([self.aggregator] if self.aggregator else [])]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._forks is not None:
            self._forks.close()
            self._forks = None


# ``--metrics-linger SECONDS``: every client serves /metrics on a loopback port, the run directory gets
# ``prometheus-targets.json`` (Prometheus ``file_sd_configs`` format), runs whose organizations share one
# architecture declare ``fedavg_model_bytes``, and every process keeps serving its final counts for SECONDS.
TARGETS_FILE = "prometheus-targets.json"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def write_targets(workdir: Path, aggregator_metrics_port: int, clients: dict[str, int]) -> Path:
    """Write the file_sd targets of a local federation atomically (``clients``: process name -> port)."""
    groups: list[dict[str, Any]] = [
        {"targets": [f"{LOOPBACK}:{aggregator_metrics_port}"], "labels": {"hetfed_component": "aggregator"}}
    ]
    groups += [{"targets": [f"{LOOPBACK}:{port}"], "labels": {"hetfed_component": "client", "hetfed_process": name}}
               for name, port in sorted(clients.items())]
    path = workdir / TARGETS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=1))
    tmp.replace(path)
    return path


def client_metrics(opts: LocalRunOptions, workdir: Path, aggregator_metrics_port: int,
                   names: list[str]) -> dict[str, dict[str, Any]]:
    """Per client process: the config fields that serve its metrics; also writes the targets file.

    Empty unless ``opts.metrics_linger`` > 0.
    """
    if opts.metrics_linger <= 0:
        return {}
    ports = {name: free_port() for name in names}
    write_targets(workdir, aggregator_metrics_port, ports)
    return {name: {"metrics_port": port, "metrics_host": LOOPBACK, "metrics_linger_seconds": opts.metrics_linger}
            for name, port in ports.items()}
