"""A local federation for the end-to-end tests: the aggregator and some organizations as real processes, one
organization in this process with every request it sends recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetfed.cli.localrun import LocalFederation, LocalRunOptions, aggregator_config, client_config
from hetfed.wire.messages import RunStatus
from tests.conftest import wait_until
from tests.e2e.recording import run_recorded


@dataclass(frozen=True)
class RecordedRun:
    """A finished local federation, still running: its processes, every run's status and the recorded client's
    requests (by RPC method) and reports."""

    fed: LocalFederation
    status: list[RunStatus]
    sent: list[tuple[str, Any]]
    reports: Any


@contextmanager
def recorded_run(workdir: Path, opts: LocalRunOptions, processes: Sequence[tuple[str, str, int]],
                 recorded: tuple[str, int], *, timeout: float = 60.0,
                 run: Callable[[dict[str, Any]], tuple[list[tuple[str, Any]], Any]] = run_recorded,
                 ) -> Iterator[RecordedRun]:
    """Start the aggregator of ``opts`` (state under ``workdir``) and one client process per (name, algorithm,
    index) of ``processes``, run the organization ``recorded`` (algorithm, index) in this process through ``run``,
    wait up to ``timeout`` seconds for every run to finish and 30 for the client processes to exit; stop every
    process on leaving."""
    fed = LocalFederation(workdir)
    try:
        fed.start_aggregator(aggregator_config(opts, str(workdir / "state")))
        for name, algorithm, index in processes:
            fed.start_client(name, client_config(opts, algorithm, index, fed.port))
        algorithm, index = recorded
        sent, reports = run(client_config(opts, algorithm, index, fed.port))
        status = wait_until(lambda: (s := fed.status()) and all(r.finished for r in s) and s, timeout=timeout,
                            what="every run to finish")
        fed.wait_clients(timeout=30)
        yield RecordedRun(fed, status, sent, reports)
    finally:
        fed.stop()


@contextmanager
def digits_clients(workdir: Path, address: str, organizations: Sequence[str], model: str,
                   crash: Mapping[str, str] | None = None) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """One real ``hetfed client`` process per organization, each on its IID share of ``digits`` with ``model``
    (config and log in ``workdir/<org>.json`` and ``<org>.log``); ``crash`` maps an organization to the client
    crash point it dies at (``HETFED_CLIENT_CRASH_AT``). Every process still alive is killed on leaving."""
    env = {k: v for k, v in os.environ.items() if k not in ("HETFED_CLIENT_CRASH_AT", "HETFED_CRASH_AT")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for i, org in enumerate(organizations):
            cfg = {"organization": org, "run": "r", "aggregator": address, "threads": 1, "device": "cpu",
                   "pull_wait_seconds": 2, "model": {"name": model},
                   "data": {"dataset": "digits", "partition": "iid", "num_clients": len(organizations),
                            "client_index": i},
                   "retry": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.5}}
            (workdir / f"{org}.json").write_text(json.dumps(cfg))
            at = (crash or {}).get(org)
            log = open(workdir / f"{org}.log", "wb")  # noqa: SIM115
            procs[org] = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "client", "--config",
                                           str(workdir / f"{org}.json")], stdout=log, stderr=subprocess.STDOUT,
                                          env=env if at is None else {**env, "HETFED_CLIENT_CRASH_AT": at})
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
