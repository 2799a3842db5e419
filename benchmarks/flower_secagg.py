"""Flower 1.42's SecAgg+ workflow on loopback, to set beside hetfed's secure aggregation: round time, bytes, CPU.

A comparison harness, not part of hetfed: nothing in hetfed imports it, and it runs in a virtual environment of
its own (Flower pins an older protobuf than hetfed's stubs need)::

    python3 -m venv $FLWR_VENV
    $FLWR_VENV/bin/pip install torch==2.13.0 && $FLWR_VENV/bin/pip install flwr==1.42.0 grpcio==1.85.1
    $FLWR_VENV/bin/python benchmarks/flower_secagg.py --clients 4,8 --params 1000000 --rounds 3 --json f.json

Flower's deployment engine, as its documentation runs SecAgg+: one ``flower-superlink`` and N
``flower-supernode`` processes (insecure, loopback), and ``flwr run`` of a Flower App written to a temporary
directory. Its ServerApp wraps a ``FedAvg`` strategy (every client fits every round, none evaluates) in
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares, reconstruction_threshold))``; its ClientApp is a
``NumPyClient`` behind ``secaggplus_mod`` whose ``fit`` returns the received vector plus a seeded update in
[-0.01, 0.01] (no training: the protocol's cost alone). The model is one float32 vector of ``--params``
elements. ``num_shares`` defaults to N (every client shares with every other: hetfed's default degree n - 1 plus
itself, as Flower counts) and ``reconstruction_threshold`` to floor(N/2) + 1 (hetfed's default t); Flower's own
quantization defaults stay (clipping range 8, 2^22 levels, modulus 2^32).

Figures, per N (one row, one JSON object with ``--json``):

- ``round_median_s``: the median over rounds 2..R of the time between consecutive ``aggregate_fit`` returns,
  read in the ServerApp process (the whole SecAgg+ round: its four stages and the aggregation);
- ``bytes_up_per_round`` / ``bytes_down_per_round``: the bytes every SuperNode sent to / received from the
  SuperLink's Fleet API through a counting TCP relay (``linkrelay.LinkRelay``), over the whole run divided by R
  (start-up and polling included: Flower's nodes poll the SuperLink);
- ``cpu_s``: user + system CPU of every process of the federation (SuperLink, ServerApp, SuperNodes and
  ClientApps: this driver's reaped descendants) for the whole run, and ``cpu_s_per_round`` that over R;
- ``wall_s``: from starting the SuperNodes to the end of the run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linkrelay import LinkRelay  # stdlib only: it runs under Flower's interpreter

SERVER_APP = '''
import json, os, time
import numpy as np
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n, params, rounds = int(cfg["clients"]), int(cfg["params"]), int(cfg["rounds"])
    marks = []

    class Timed(FedAvg):
        def aggregate_fit(self, rnd, results, failures):
            out = super().aggregate_fit(rnd, results, failures)
            marks.append([rnd, time.monotonic(), len(results), len(failures)])
            return out

    strategy = Timed(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0,
                     min_evaluate_clients=0, initial_parameters=ndarrays_to_parameters(
                         [np.zeros(params, dtype=np.float32)]))
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
        num_shares=int(cfg["num_shares"]), reconstruction_threshold=int(cfg["threshold"])))
    workflow(grid, legacy)
    with open(str(cfg["out"]), "w") as f:
        json.dump(marks, f)
'''

CLIENT_APP = '''
import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context


class Client(NumPyClient):
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def fit(self, parameters, config):
        w = parameters[0]
        return [w + self.rng.uniform(-0.01, 0.01, w.shape).astype(np.float32)], 64, {}


def client_fn(context: Context):
    return Client(int(context.node_id) % (2 ** 32)).to_client()


app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
'''

PYPROJECT = '''
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "secaggbench"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hetfed"

[tool.flwr.app.components]
serverapp = "secaggbench.server_app:app"
clientapp = "secaggbench.client_app:app"

[tool.flwr.app.config]
clients = 4
params = 1000
rounds = 3
num_shares = 4
threshold = 3
out = ""
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout} s")


def write_app(root: Path) -> Path:
    app = root / "secaggbench"
    app.mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    pkg = app / "secaggbench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server_app.py").write_text(SERVER_APP)
    (pkg / "client_app.py").write_text(CLIENT_APP)
    return app


def one(n: int, params: int, rounds: int, bindir: Path, logs: Path) -> dict[str, float]:
    """One federation of ``n`` SuperNodes for ``rounds`` SecAgg+ rounds of ``params`` float32 elements."""
    root = Path(tempfile.mkdtemp(prefix="flwr-secagg-"))
    app = write_app(root)
    home = root / "flwr-home"
    home.mkdir()
    link = free_port()  # 1.42: the SuperLink's one HTTP runtime API serves the Fleet and the Control API
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "FLWR_HOME": str(home),
           "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}  # Flower starts its flower-superexec
    out = root / "marks.json"
    procs: list[subprocess.Popen[bytes]] = []
    relay = LinkRelay(("127.0.0.1", link))

    def start(name: str, cmd: list[str]) -> None:
        log = open(logs / f"{name}-{n}.log", "wb")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                      start_new_session=True))

    try:
        start("superlink", [str(bindir / "flower-superlink"), "--insecure", "--port", str(link),
                            "--disable-runtime-dependency-installation", f"--database={root / 'state.db'}"])
        wait_port(link)
        relay_port = relay.start()
        t0 = time.monotonic()
        for i in range(n):
            start(f"supernode{i}", [str(bindir / "flower-supernode"), "--insecure",
                                    f"--superlink=127.0.0.1:{relay_port}",
                                    "--port", str(free_port()),
                                    f"--node-config=partition-id={i}"])
        cfg = (f"clients={n} params={params} rounds={rounds} num_shares={n} threshold={n // 2 + 1} "
               f"out='{out}'")
        subprocess.run([str(bindir / "flwr"), "run", str(app), "bench", "--run-config", cfg, "--stream"],
                       env=env, cwd=root, check=True, stdout=open(logs / f"run-{n}.log", "wb"),  # noqa: SIM115
                       stderr=subprocess.STDOUT, timeout=3600)
        end = time.monotonic() + 600
        while not out.exists() and time.monotonic() < end:
            time.sleep(0.2)
        wall = time.monotonic() - t0
        marks = json.loads(out.read_text())
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        relay.stop()
    if len(marks) != rounds or any(m[2] != n or m[3] for m in marks):
        raise RuntimeError(f"Flower closed {marks} (round, time, results, failures); expected {rounds} rounds of {n}")
    periods = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    return {"clients": n, "params": params, "rounds": rounds,
            "round_median_s": statistics.median(periods) if periods else float("nan"),
            "bytes_up_per_round": relay.bytes_up / rounds, "bytes_down_per_round": relay.bytes_down / rounds,
            "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="4", help="comma-separated N (default 4)")
    ap.add_argument("--params", default="1000000", help="comma-separated vector sizes (default 1000000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--logs", type=Path, help="keep every process's log here (default: a temporary directory)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bindir = Path(sys.executable).parent
    logs = args.logs or Path(tempfile.mkdtemp(prefix="flwr-secagg-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'N':>3} {'params':>10} {'round s':>8} {'MB up/rnd':>10} {'MB down/rnd':>11} {'CPU s/rnd':>9}")
    for params in (int(p) for p in args.params.split(",")):
        for n in (int(c) for c in args.clients.split(",")):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            row = one(n, params, args.rounds, bindir, logs)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            row["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            row["cpu_s_per_round"] = row["cpu_s"] / args.rounds
            rows.append(row)
            print(f"{n:>3} {params:>10} {row['round_median_s']:>8.2f} {row['bytes_up_per_round'] / 1e6:>10.2f} "
                  f"{row['bytes_down_per_round'] / 1e6:>11.2f} {row['cpu_s_per_round']:>9.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
