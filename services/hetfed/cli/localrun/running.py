"""``hetfed run`` end to end: plan, start the processes, follow the runs, then print and write the results."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfed.aggregator.journal.store import holder_of
from hetfed.cli.localrun.files import OPERATOR_ORGANIZATION, aggregator_config, client_file, client_settings
from hetfed.cli.localrun.planning import CLIENT_STATE, LocalPlan, LocalRunOptions, plan
from hetfed.cli.localrun.processes import LocalFederation, client_metrics
from hetfed.cli.localrun.results import TABLE_HEAD, own_final, summarize_run, table_rows
from hetfed.cli.report import write_report
from hetfed.client import catalog
from hetfed.client.catalog import PARTITIONS
from hetfed.wire.config import ConfigError, to_mapping, to_sparse_mapping
from hetfed.wire.messages import RunStatus

if TYPE_CHECKING:
    from hetfed.cli.certs import FederationCerts


def settled_status(fed: LocalFederation, status: list[RunStatus], by_run: Mapping[str, Sequence[str]],
                   timeout: float = 30.0, poll: float = 0.1) -> list[RunStatus]:
    """The Status of every run once it is over, read again after the clients exited.

    The federation loop also ends once every client has exited, and a Status read just before the last round
    closed lacks that round's reports (seen at 1,400 rounds, where every final figure came back empty). The
    aggregator still serves: read it until each run is finished or all its organizations left it (privacy
    budgets spent), at most ``timeout`` seconds; then the last read stands.
    """
    def over(runs: list[RunStatus]) -> bool:
        gone = set(fed.left_clients())
        return all(s.finished or all(n in gone for n in by_run.get(s.run_id, ())) for s in runs)

    deadline = time.monotonic() + timeout
    while not over(status) and time.monotonic() < deadline:
        fed.raise_if_failed()
        status = fed.status()
        if not over(status):
            time.sleep(poll)
    return status


def federate(opts: LocalRunOptions | LocalPlan, workdir: Path,
             on_status: Callable[[LocalFederation, list[RunStatus]], None] | None = None) -> list[dict[str, Any]]:
    """Run every algorithm of ``opts`` on one local aggregator; returns each run's summary.

    ``on_status`` sees the federation and each Status it polls (benchmarks measure the processes with it).
    """
    from hetfed.cli.progress import Progress

    p = opts if isinstance(opts, LocalPlan) else plan(opts)
    o = p.opts
    certs = _make_certs(p.clients, workdir) if o.tls else None
    fed = LocalFederation(workdir, certs.client_tls(OPERATOR_ORGANIZATION) if certs else None,
                          warm=[to_sparse_mapping(p.data[0])])
    started = time.monotonic()
    state = workdir / "state"
    if state.exists():  # a local run is one-shot: an earlier run's state in the same directory is not resumed
        for run_dir in sorted(p for p in state.iterdir() if p.is_dir()):
            if (holder := holder_of(run_dir)) is not None:
                raise ConfigError(f"{run_dir} is in use by an aggregator still running ({holder}): stop it, or "
                                  "give this run another --output")
        shutil.rmtree(state)
    if (workdir / CLIENT_STATE).exists():  # nor are its clients' ledgers: ε of this run starts at zero
        shutil.rmtree(workdir / CLIENT_STATE)
    try:
        fed.start_aggregator(aggregator_config(p, str(state), certs.aggregator_tls() if certs else None))
        names = {(r.run_id, i): f"client-{r.run_id}-org-{i}" for r in p.runs for i in range(p.clients)}
        scrape = client_metrics(o, workdir, fed.metrics_port, list(names.values()))
        for (run_id, i), name in names.items():
            client_tls = certs.client_tls(f"org-{i}") if certs else None
            cfg = dataclasses.replace(client_settings(p, run_id, i, fed.port, client_tls), **scrape.get(name, {}))
            fed.start_client(name, client_file(cfg))
        by_run = {run_id: [name for (r, _), name in names.items() if r == run_id] for run_id in {r for r, _ in names}}
        # Organizations that left a run because their privacy budget was spent (their client exited
        # PRIVACY_BUDGET_SPENT): reported once each; the run goes on for the others under its quorum rules.
        left: dict[str, list[str]] = {run_id: [] for run_id in by_run}

        def departures(progress: Progress) -> None:
            gone = set(fed.left_clients())
            for (run_id, i), name in names.items():
                if name in gone and f"org-{i}" not in left[run_id]:
                    left[run_id].append(f"org-{i}")
                    progress.note(f"org-{i} left run {run_id}: its privacy budget is spent")

        with Progress(quiet=o.quiet) as progress:
            while True:
                fed.raise_if_failed()
                departures(progress)
                status = fed.status()
                if on_status is not None:
                    on_status(fed, status)
                progress.update(status)
                # A run is over when it finished, or when every one of its organizations left it (nobody is
                # left to push the round it waits for).
                if all(s.finished or all(fed.exited(n) for n in by_run[s.run_id]) for s in status):
                    break
                if time.monotonic() - started > o.timeout:
                    raise TimeoutError(f"the federation did not finish within {o.timeout}s")
                # Status carries every round's history: poll long runs (thousands of rounds) less often.
                time.sleep(0.25 if max(s.round for s in status) < 200 else 1.0)
        fed.wait_clients(timeout=60)
        departures(progress)  # those that left after the loop's last look
        status = settled_status(fed, status, by_run)
        wall = time.monotonic() - started
        results = []
        for s in status:
            summary = summarize_run(s, left.get(s.run_id, []))
            clients = next((r.clients for r in p.runs if r.run_id == s.run_id), ())
            summary.update(own_final(summary, clients, workdir))
            summary["wall_seconds"] = wall
            results.append(summary)
        return results
    finally:
        fed.stop()


def _make_certs(clients: int, workdir: Path) -> FederationCerts:
    """A fresh CA and certificates for this local federation (and the orchestrator) in ``workdir/certs``."""
    from hetfed.cli.certs import make_federation_certs

    orgs = [f"org-{i}" for i in range(clients)]
    # Absolute paths: the processes run with the work directory as their current directory.
    return make_federation_certs((workdir / "certs").resolve(), [*orgs, OPERATOR_ORGANIZATION], force=True)


def output_dir(path: str) -> Path:
    """``--output PATH`` as an absolute, writable directory (made when missing); ConfigError in one line when it
    cannot be, so a mistake surfaces before any process starts rather than as a traceback."""
    # Absolute: the processes it starts run inside it and are handed paths in it.
    workdir = Path(path).resolve()
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--output {path}: exists and is not a directory")
    blocker = next((a for a in workdir.parents if a.exists()), None)
    if not workdir.exists() and blocker is not None and not blocker.is_dir():
        raise ConfigError(f"--output {path}: cannot create the directory: {blocker} is a file")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output {path}: cannot create the directory: {exc.strerror or exc}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {path}: the directory is not writable")
    return workdir


def run_local(opts: LocalRunOptions) -> int:
    """The ``hetfed run`` command: validate, federate, print the table, write results.json when asked."""
    p = plan(opts)  # every user error surfaces here, before any process starts
    if opts.output:
        return _run_in(p, output_dir(opts.output))
    with tempfile.TemporaryDirectory(prefix="hetfed-run-") as tmp:
        return _run_in(p, Path(tmp))


def _run_in(p: LocalPlan, workdir: Path) -> int:
    from hetfed.cli.progress import print_table, say

    o = p.opts
    if not o.quiet:
        detail = "".join(f", {k}={getattr(p.data[0], k)}" for k in PARTITIONS[p.partition].parameters)
        rounds = ", ".join(f"{r.spec.name} {r.rounds}" for r in p.runs)
        say(f"hetfed run: {', '.join(o.algorithms)} with {p.clients} organizations on {o.dataset} "
            f"({p.partition}{detail}), rounds: {rounds}, seed {o.seed}")
    if p.privacy and not o.output:
        say("hetfed run: privacy ledgers are ephemeral (privacy.ephemeral_ledger): they end with this temporary "
            "run; give --output to keep them")
    results = federate(p, workdir)
    print_table(TABLE_HEAD, table_rows(results))
    if p.picture:
        for r in results:
            png = catalog.draw_picture(p.picture, workdir, r["run"], Path(o.output or "."))
            if png is not None:
                say(f"{r['algorithm']}: {png}")
    if o.output:
        out = {"options": to_mapping(dataclasses.replace(o, clients=p.clients)), "runs": results}
        (workdir / "results.json").write_text(json.dumps(out, indent=2, default=list))
        say(f"per-round results: {workdir / 'results.json'}")
        if o.report:
            private = any((r.get("privacy") or {}).get("epsilon_max") is not None for r in results)
            say(f"accuracy against bytes{' and ε' if private else ''}: "
                f"{write_report([workdir / 'results.json'], workdir)}")
    return 0
