"""``hetfed run``: a real aggregator and real client processes on loopback, one run per algorithm.

Nothing is simulated: the aggregator and every organization are separate processes started with the
same ``hetfed aggregator`` / ``hetfed client`` commands a Kubernetes deployment runs, talking gRPC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfed.cli.report import write_report
from hetfed.cli.scrape import client_metrics, declare_fedavg_reference
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.config import to_mapping
from hetfed.wire.transport import TlsConfig, make_channel

if TYPE_CHECKING:
    from hetfed.cli.certs import FederationCerts

# The orchestrator's own certificate under --tls: a name no run lists, good only for the read-only Status.
OPERATOR_ORGANIZATION = "hetfed-operator"


@dataclass(frozen=True)
class LocalRunOptions:
    """What ``hetfed run`` federates and how."""

    algorithms: tuple[str, ...] = ("fedavg", "local")
    clients: int = 4
    rounds: int = 10
    dataset: str = "mnist5k"
    partition: str = "dirichlet"
    alpha: float = 0.5
    seed: int = 0
    model: str = "lenet"
    # Per-organization architectures (cycled); overrides `model` when set.
    models: tuple[str, ...] = ()
    latent_dim: int = 0
    # Own test sets of dirichlet partitions: "proportional" or "fedgen" (hetfed.client.data.split_like).
    test_split: str = "proportional"
    # Clients write model snapshots and probe latents under <workdir>/artifacts (hetfed.client.artifacts).
    artifacts: bool = False
    local_epochs: int = 2
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 32
    wire_dtype: str = "float32"
    output: str | None = None
    timeout: float = 1800.0
    extra_algorithm_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Partition "rotated": the seed-set fraction alpha of each domain; train on the whole seed set too (AGG).
    public_fraction: float = 0.1
    train_on_public: bool = False
    quiet: bool = False
    # Federate over mTLS with certificates generated into <workdir>/certs.
    tls: bool = False
    # > 0: set up for a Prometheus (client metrics, <workdir>/prometheus-targets.json; hetfed.cli.scrape).
    metrics_linger: float = 0.0
    # Write report.png and report.md (hetfed.cli.report) next to results.json.
    report: bool = True


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


class LocalFederation:
    """Starts, watches and stops an aggregator process and its client processes."""

    def __init__(self, workdir: Path, tls: TlsConfig | None = None) -> None:
        self.workdir = workdir
        # The orchestrator's client certificate when the aggregator requires mTLS.
        self.tls = tls
        self.env = _subprocess_env()
        self.aggregator: subprocess.Popen[bytes] | None = None
        self.clients: dict[str, subprocess.Popen[bytes]] = {}
        self.port = 0
        self.metrics_port = -1

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
                raise RuntimeError(f"the aggregator exited with {self.aggregator.returncode}:\n{self.log_tail('aggregator')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the aggregator did not start within {timeout}s")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.metrics_port = int(info["port"]), int(info["metrics_port"])

    def start_client(self, name: str, config: dict[str, Any]) -> None:
        """Write a client config and start that organization's process."""
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(config, indent=2))
        self.clients[name] = self._spawn(name, ["client", "--config", str(path)])

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of a process's log."""
        p = self.workdir / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""

    def failed_client(self) -> str | None:
        """The name of a client process that exited with an error, if any."""
        for name, proc in self.clients.items():
            if proc.poll() not in (None, 0):
                return name
        return None

    def raise_if_failed(self) -> None:
        """Raise with the log's tail if a client failed or the aggregator exited while a run is in progress."""
        bad = self.failed_client()
        if bad:
            raise RuntimeError(f"{bad} failed:\n{self.log_tail(bad)}")
        if self.aggregator is not None and self.aggregator.poll() is not None:
            raise RuntimeError(f"the aggregator exited:\n{self.log_tail('aggregator')}")

    def status(self, timeout: float = 10.0) -> apb.StatusResponse:
        """The aggregator's Status of every run."""
        with make_channel(f"127.0.0.1:{self.port}", self.tls) as ch:
            return agrpc.AggregatorStub(ch).Status(apb.StatusRequest(), timeout=timeout)

    def wait_clients(self, timeout: float) -> None:
        """Wait for every client process to exit."""
        deadline = time.monotonic() + timeout
        for proc in self.clients.values():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def stop(self) -> None:
        """Terminate everything still running (gracefully, then by force)."""
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


def aggregator_config(opts: LocalRunOptions, state_dir: str, tls: TlsConfig | None = None) -> dict[str, Any]:
    """The aggregator config of a local federation: one run per algorithm."""
    runs = []
    for algo in opts.algorithms:
        algo_cfg: dict[str, Any] = {
            "local_epochs": opts.local_epochs,
            "lr": opts.lr,
            "momentum": opts.momentum,
            "batch_size": opts.batch_size,
            "wire_dtype": opts.wire_dtype,
            **opts.extra_algorithm_config.get(algo, {}),
        }
        runs.append({
            "id": algo.replace("_", "-"),
            "algorithm": algo,
            "organizations": [f"org-{i}" for i in range(opts.clients)],
            "rounds": opts.rounds,
            "round_deadline_seconds": 600.0,
            "seed": opts.seed,
            "algorithm_config": algo_cfg,
        })
        if algo == "fedh2l":
            from hetfed.cli.fedh2l_local import apply_fedh2l

            apply_fedh2l(runs[-1], opts.dataset, opts.partition, opts.clients, opts.seed, opts.public_fraction,
                         opts.extra_algorithm_config.get(algo, {}))
        if algo == "fedcma":
            from hetfed.cli.fedcma_local import fedcma_run_defaults

            fedcma_run_defaults(runs[-1], opts)
    declare_fedavg_reference(runs, opts)
    server: dict[str, Any] = {
        "listen": "127.0.0.1:0", "metrics_port": 0, "metrics_host": "127.0.0.1", "state_dir": state_dir,
    }
    if tls is not None:
        server["tls"] = to_mapping(tls)
        server["operators"] = [OPERATOR_ORGANIZATION]
    return {"server": server, "runs": runs}


def client_config(
    opts: LocalRunOptions, run_id: str, index: int, port: int, tls: TlsConfig | None = None
) -> dict[str, Any]:
    """The config of organization ``index`` in run ``run_id`` (``tls``: its certificate, under mTLS)."""
    models = opts.models or (opts.model,)
    if not opts.models and run_id == "fedh2l":
        from hetfed.cli.fedh2l_local import DEFAULT_MODELS

        models = DEFAULT_MODELS
    cfg: dict[str, Any] = {
        "organization": f"org-{index}",
        "run": run_id,
        "aggregator": f"127.0.0.1:{port}",
        "device": "auto",
        "threads": 1,
        "data": {
            "dataset": opts.dataset,
            "partition": opts.partition,
            "alpha": opts.alpha,
            "num_clients": opts.clients,
            "client_index": index,
            "seed": opts.seed,
        },
        "model": {"name": models[index % len(models)], "latent_dim": opts.latent_dim},
        "retry": {"give_up_after_seconds": 120.0},
    }
    if opts.dataset == "gauss4":  # the 2-D toy: one fixed split, flat inputs, a 2-D latent space to draw
        cfg["data"]["partition"] = "natural"
        if not opts.models and opts.model == "lenet":
            cfg["model"]["name"] = "mlp"
        cfg["model"]["latent_dim"] = opts.latent_dim or 2
    if opts.test_split != "proportional":
        cfg["data"]["test_split"] = opts.test_split
    if run_id == "fedcma" or opts.artifacts or opts.dataset == "gauss4":
        from hetfed.cli.fedcma_local import artifacts_dir, fedcma_client_defaults

        if run_id == "fedcma":
            fedcma_client_defaults(cfg, opts, index)
        if opts.artifacts or opts.dataset == "gauss4":
            cfg["output_dir"] = artifacts_dir(run_id, f"org-{index}")
    if opts.partition == "rotated":
        cfg["data"].update(public_fraction=opts.public_fraction, train_on_public=opts.train_on_public)
    if tls is not None:
        cfg["tls"] = to_mapping(tls)
    return cfg


def summarize_run(status: apb.RunStatus) -> dict[str, Any]:
    """Per-round results of a finished run and its final figures, as JSON-ready dicts."""
    rounds: list[dict[str, Any]] = []
    for rec in status.history:
        up: dict[str, int] = {}
        down: dict[str, int] = {}
        for t in rec.traffic:
            side = up if t.direction == "up" else down
            side[t.payload_kind] = side.get(t.payload_kind, 0) + t.bytes
        reports = {r.organization_id: r.metrics for r in rec.reports}
        n_test = sum(m.num_test_examples for m in reports.values())
        acc = sum(m.test_accuracy * m.num_test_examples for m in reports.values()) / n_test if n_test else None
        gaccs = [m.extra["global_test_accuracy"] for m in reports.values() if "global_test_accuracy" in m.extra]
        n_train = sum(m.num_train_examples for m in reports.values())
        loss = sum(m.train_loss * m.num_train_examples for m in reports.values()) / n_train if n_train else None
        rounds.append({
            "round": rec.round,
            "clients": rec.clients,
            "duration_seconds": rec.duration_seconds,
            "test_accuracy": acc,
            "global_test_accuracy": sum(gaccs) / len(gaccs) if gaccs else None,
            "train_loss": loss,
            "bytes_up": up,
            "bytes_down": down,
            "per_organization": {
                org: {"test_accuracy": m.test_accuracy, "train_loss": m.train_loss, **dict(m.extra)}
                for org, m in sorted(reports.items())
            },
        })
    final = rounds[-1] if rounds else {}
    train_rounds = [r for r in rounds if r["round"] >= 1][: status.total_rounds]
    total_up = sum(sum(r["bytes_up"].values()) for r in rounds)
    total_down = sum(sum(r["bytes_down"].values()) for r in rounds)
    return {
        "run": status.run_id,
        "algorithm": status.algorithm,
        "rounds": rounds,
        "final_test_accuracy": final.get("test_accuracy"),
        "final_global_test_accuracy": final.get("global_test_accuracy"),
        # Domain partitions (rotated): the mean over organizations of WDP, CDP and ACC in the final report.
        "final_domain_metrics": {
            k: sum(m[k] for m in final["per_organization"].values()) / len(final["per_organization"])
            for k in ("wdp", "cdp", "acc")
            if final and final["per_organization"] and all(k in m for m in final["per_organization"].values())
        },
        "bytes_up_total": total_up,
        "bytes_down_total": total_down,
        "bytes_per_train_round": (
            sum(sum(r["bytes_up"].values()) + sum(r["bytes_down"].values()) for r in train_rounds)
            / max(1, len(train_rounds))
        ),
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table of final accuracy and bytes per algorithm."""
    head = ("algorithm", "own-test acc", "global-test acc", "bytes up", "bytes down", "bytes/round", "time")
    rows = [head]
    for r in results:
        g = r["final_global_test_accuracy"]
        rows.append((
            r["algorithm"],
            f"{100 * r['final_test_accuracy']:.2f}%" if r["final_test_accuracy"] is not None else "-",
            f"{100 * g:.2f}%" if g is not None else "-",
            _fmt_bytes(r["bytes_up_total"]),
            _fmt_bytes(r["bytes_down_total"]),
            _fmt_bytes(r["bytes_per_train_round"]),
            f"{r.get('wall_seconds', 0):.0f}s",
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _bar(status: apb.RunStatus, width: int = 24) -> str:
    done = min(status.total_rounds, max(0, status.round - 1))
    if status.state == apb.RUN_STATE_FINISHED or status.state == apb.RUN_STATE_EVALUATING:
        done = status.total_rounds
    filled = int(width * done / max(1, status.total_rounds))
    acc = ""
    for rec in reversed(status.history):
        if rec.reports:
            n = sum(r.metrics.num_test_examples for r in rec.reports)
            if n:
                acc = f"  acc {100 * sum(r.metrics.test_accuracy * r.metrics.num_test_examples for r in rec.reports) / n:5.1f}%"
            break
    state = apb.RunState.Name(status.state).removeprefix("RUN_STATE_").lower()
    return f"{status.algorithm:<12} [{'#' * filled}{'.' * (width - filled)}] {done:>3}/{status.total_rounds} {state:<10}{acc}"


def federate(opts: LocalRunOptions, workdir: Path,
             on_status: Callable[[LocalFederation, apb.StatusResponse], None] | None = None) -> list[dict[str, Any]]:
    """Run every algorithm of ``opts`` on one local aggregator; returns each run's summary.

    ``on_status`` sees the federation and each Status it polls (benchmarks measure the processes with it).
    """
    certs = _make_certs(opts, workdir) if opts.tls else None
    fed = LocalFederation(workdir, certs.client_tls(OPERATOR_ORGANIZATION) if certs else None)
    started = time.monotonic()
    try:
        fed.start_aggregator(aggregator_config(opts, str(workdir / "state"), certs.aggregator_tls() if certs else None))
        scrape = client_metrics(opts, workdir, fed.metrics_port, [f"client-{a.replace('_', '-')}-org-{i}"
                                                                  for a in opts.algorithms for i in range(opts.clients)])
        for algo in opts.algorithms:
            run_id = algo.replace("_", "-")
            for i in range(opts.clients):
                client_tls = certs.client_tls(f"org-{i}") if certs else None
                name = f"client-{run_id}-org-{i}"
                fed.start_client(name, {**client_config(opts, run_id, i, fed.port, client_tls), **scrape.get(name, {})})
        tty = sys.stdout.isatty() and not opts.quiet
        last: dict[str, str] = {}
        while True:
            fed.raise_if_failed()
            status = fed.status()
            if on_status is not None:
                on_status(fed, status)
            bars = [_bar(s) for s in status.runs]
            if tty:
                sys.stdout.write("".join(f"\r\x1b[2K{b}\n" for b in bars) + f"\x1b[{len(bars)}A")
                sys.stdout.flush()
            elif not opts.quiet:
                for s, b in zip(status.runs, bars, strict=True):
                    if last.get(s.run_id) != b.split("  acc")[0]:
                        last[s.run_id] = b.split("  acc")[0]
                        print(b, flush=True)
            if all(s.state == apb.RUN_STATE_FINISHED for s in status.runs):
                break
            if time.monotonic() - started > opts.timeout:
                raise TimeoutError(f"the federation did not finish within {opts.timeout}s")
            # Status carries every round's history: poll long runs (FedH2L's thousands of rounds) less often.
            time.sleep(0.25 if max(s.round for s in status.runs) < 200 else 1.0)
        if tty:
            sys.stdout.write("\n" * len(status.runs))
        fed.wait_clients(timeout=60)
        wall = time.monotonic() - started
        results = []
        for s in status.runs:
            summary = summarize_run(s)
            summary["wall_seconds"] = wall
            results.append(summary)
        return results
    finally:
        fed.stop()


def _make_certs(opts: LocalRunOptions, workdir: Path) -> FederationCerts:
    """A fresh CA and certificates for this local federation (and the orchestrator) in ``workdir/certs``."""
    from hetfed.cli.certs import make_federation_certs

    orgs = [f"org-{i}" for i in range(opts.clients)]
    # Absolute paths: the processes run with the work directory as their current directory.
    return make_federation_certs((workdir / "certs").resolve(), [*orgs, OPERATOR_ORGANIZATION], force=True)


def run_local(opts: LocalRunOptions) -> int:
    """The ``hetfed run`` command: federate, print the table, write results.json when asked."""
    if opts.output:
        # Absolute: the processes it starts run inside it and are handed paths in it.
        workdir = Path(opts.output).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        return _run_in(opts, workdir)
    with tempfile.TemporaryDirectory(prefix="hetfed-run-") as tmp:
        return _run_in(opts, Path(tmp))


def _run_in(opts: LocalRunOptions, workdir: Path) -> int:
    if not opts.quiet:
        print(f"hetfed run: {', '.join(opts.algorithms)} with {opts.clients} organizations on {opts.dataset} "
              f"({opts.partition}{f', alpha={opts.alpha}' if opts.partition == 'dirichlet' else ''}), "
              f"{opts.rounds} rounds, seed {opts.seed}", flush=True)
    results = federate(opts, workdir)
    print(format_table(results))
    for r in results:
        if r["final_domain_metrics"]:
            print(f"{r['algorithm']}: mean over organizations " + "  ".join(
                f"{k.upper()} {100 * v:.2f}%" for k, v in r["final_domain_metrics"].items()))
    if opts.dataset == "gauss4":
        from hetfed.client.diagnostics import plot_gauss4

        for r in results:
            png = plot_gauss4(workdir, r["run"], Path(opts.output or "."))
            if png is not None:
                print(f"latent spaces and decision boundaries: {png}")
    if opts.output:
        out = {"options": to_mapping(opts), "runs": results}
        (workdir / "results.json").write_text(json.dumps(out, indent=2, default=list))
        print(f"per-round results: {workdir / 'results.json'}")
        if opts.report:
            print(f"accuracy against bytes: {write_report([workdir / 'results.json'], workdir)}")
    return 0
