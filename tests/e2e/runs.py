"""A local federation for the end-to-end tests: the aggregator and some organizations as real processes, one
organization in this process with every request it sends recorded."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
