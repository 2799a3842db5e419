"""Flower's fastest legacy path on round_overhead.py's workload A, to set beside hetfed's figures.

A comparison harness, not part of hetfed's runtime: nothing in hetfed imports it, and it runs in a virtual
environment of its own, since Flower pins a protobuf (< 7) older than the one hetfed's generated stubs need::

    python3 -m venv $FLWR_VENV
    $FLWR_VENV/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # first: the CPU build, kept by flwr
    $FLWR_VENV/bin/pip install flwr==1.42.0 grpcio==1.85.1   # hetfed's gRPC core (it excludes 1.85.3)
    $FLWR_VENV/bin/python benchmarks/flower_round.py --clients 4,8,32 --rounds 12 --json flower.json

(and ``python benchmarks/round_overhead.py --workload A --clients 4,8,32 --rounds 12`` in hetfed's environment
for the other side). No hetfed module is imported: the model is defined here, layer for layer the same as
``hetfed.client.models.build_model("mlp1", (1, 28, 28), 10, latent_dim=1258)`` (state-dict keys, shapes,
1,000,120 parameters, and the same initial weights: built under seed 0 in the same order). The driver builds
it once and hands the server its initial weights as an npz, so that the server, like hetfed's aggregator,
never imports torch (its peak RSS would otherwise carry torch's few hundred MB).

The federation, for each N: one Flower server process (``flwr.server.start_server`` on 127.0.0.1, a ``FedAvg``
strategy with fraction_fit=1.0, min_fit_clients = min_available_clients = N, fraction_evaluate=0 so no round
evaluates, initial parameters given so no client is asked for them, in-place aggregation, and a server whose
thread pool has one worker per client: Flower's default pool, min(32, cores + 4), would let only that many
clients train at once) and N client processes (``flwr.client.start_client`` with a ``NumPyClient.to_client()``
instance, built once per process). The transport is Flower's legacy gRPC bidirectional stream,
"grpc-bidi" (one ``Join`` stream per client, the only transport ``start_client`` still accepts in 1.42; both
calls are deprecated in favour of SuperLink/SuperNode). Each client holds round_overhead.py's data (64 random
28x28 float32 images, labels in 0..9, the same random stream as its ``write_data(seed=1)``), uses one torch
thread, and its ``fit`` loads the global weights into the model, takes one SGD step (lr 0.01, momentum 0, a fresh
optimiser as hetfed's clients make) on a batch of 8 (the first 8 of a fresh permutation, as hetfed's
``epoch_batches`` draws it) and returns the weights. Plaintext loopback; Flower's telemetry is turned off.

Figures, per N (one table row, and one JSON row with ``--json``):

- ``round_median_s``: the median over rounds 2..R of the time between consecutive rounds' closes (the return of
  ``aggregate_fit``), read with time.monotonic() in the server process by a FedAvg subclass: one whole round,
  sending the global model, training, receiving and aggregating (hetfed's round duration runs from the end of
  the previous close to the start of this one's: ``aggregate_median_s`` is the part of Flower's round spent in
  ``aggregate_fit``, which FedAvg runs at the close over all N results at once);
- ``cpu_s_per_round``: core-seconds per round of every process (the server and all clients): each process
  reads its own user+system CPU time (os.times, all threads) at its round-1 and round-R marks (the server at
  each round's close, a client at the end of each fit), the sum of the differences over R-1 rounds;
- ``server_peak_rss_mb``: the server's VmHWM (/proc/PID/status) read by the server itself at the end, and by
  this driver while it runs (the larger); ``client_peak_rss_mb``: the largest client's;
- ``time_to_round1_s``: from starting the first client process (the server already listening) to the start
  of round 1 (``configure_fit`` returning: every client has joined); ``first_fit_s``: from a client process's
  start to its first fit (the largest over clients), ``import_s``: of that, a client's start-up (interpreter,
  torch and flwr imports, model and data; the largest);
- ``payload_mb_per_round``: the serialised tensors one round moves, 2·N times the global model's bytes.

Options: ``--python`` runs the server and clients under another interpreter (default: this one),
``--max-workers K`` gives the server Flower's pool of K threads instead of N, ``--logs DIR`` keeps each
federation's logs and marks under DIR/N, ``--timeout`` bounds each federation (Flower's own round_timeout stays
unset, its fastest path; every wait of this driver is bounded, and SIGTERM or any error stops all the processes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Workload A of round_overhead.py.
IMAGE_SHAPE = (1, 28, 28)
CLASSES = 10
LATENT_DIM = 1258
EXAMPLES = 64
BATCH = 8
LR = 0.01
MOMENTUM = 0.0
DATA_SEED = 1  # round_overhead.py's write_data(..., seed=1)
MODEL_SEED = 0  # build_model's default seed
# hetfed's mlp1 at d_e = 1258: Linear(784, 1258) + Linear(1258, 10), weights and biases.
HETFED_MLP1_PARAMETERS = 1_000_120
HETFED_MLP1_SHAPES = {"encoder.1.weight": (1258, 784), "encoder.1.bias": (1258,),
                      "head.weight": (10, 1258), "head.bias": (10,)}

POLL_SECONDS = 0.2
LISTEN_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 30.0

_CHILDREN: list[subprocess.Popen[bytes]] = []


# --------------------------------------------------------------------------------------------- shared helpers

def _cpu_seconds() -> float:
    """This process's user + system CPU seconds, all threads."""
    t = os.times()
    return t.user + t.system


def _vm_hwm(pid: int | str = "self") -> int:
    """Peak RSS (VmHWM) of a process in bytes, 0 if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def build_mlp1() -> Any:
    """hetfed's ``mlp1`` at d_e = 1258 as a plain torch module: encoder Flatten-Linear(784, 1258)-ReLU, head
    Linear(1258, 10), built under seed 0 in hetfed's order (encoder, then head), the global RNG left as it was."""
    import torch
    from torch import nn

    class MLP1(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
            self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(inputs, LATENT_DIM), nn.ReLU())
            self.head = nn.Linear(LATENT_DIM, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.encoder(x))
            return out

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = MLP1()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == HETFED_MLP1_SHAPES, shapes
    assert sum(p.numel() for p in model.parameters()) == HETFED_MLP1_PARAMETERS
    return model


def write_initial(path: Path) -> None:
    """The model's initial weights, for the server (which then needs no torch), as an npz by state-dict key."""
    import numpy as np

    np.savez(path, **{k: v.numpy() for k, v in build_mlp1().state_dict().items()})


# --------------------------------------------------------------------------------------------- server process

def server_main(args: argparse.Namespace) -> int:
    """The Flower server: FedAvg for ``rounds`` rounds over ``clients`` clients; writes its marks to ``out``."""
    import numpy as np
    from flwr.common import ndarrays_to_parameters
    from flwr.server import Server, ServerConfig, SimpleClientManager, start_server
    from flwr.server.strategy import FedAvg

    marks: dict[str, Any] = {"open": {}, "aggregate": {}, "close": {}, "cpu_close": {}, "payload_bytes": 0}

    class TimedFedAvg(FedAvg):  # type: ignore[misc]
        """FedAvg that records when each round opens (its clients sampled) and closes (aggregated)."""

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            instructions = super().configure_fit(server_round, parameters, client_manager)
            marks["open"][server_round] = time.monotonic()
            marks["payload_bytes"] = sum(len(t) for t in parameters.tensors)
            return instructions

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            if failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} failed clients: {failures[:3]}")
            marks["aggregate"][server_round] = time.monotonic()
            out = super().aggregate_fit(server_round, results, failures)
            marks["close"][server_round] = time.monotonic()
            marks["cpu_close"][server_round] = _cpu_seconds()
            return out

    with np.load(args.initial) as npz:  # the driver's build_mlp1(): the server imports no torch, as hetfed's
        initial = ndarrays_to_parameters([npz[k] for k in HETFED_MLP1_SHAPES])
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=args.clients,
                           min_evaluate_clients=args.clients, min_available_clients=args.clients,
                           initial_parameters=initial, accept_failures=False, inplace=True,
                           fit_metrics_aggregation_fn=lambda _metrics: {})
    server = Server(client_manager=SimpleClientManager(), strategy=strategy)
    server.set_max_workers(args.clients if args.max_workers == 0 else args.max_workers)
    marks["ready"] = time.monotonic()
    start_server(server_address=f"127.0.0.1:{args.port}", server=server,
                 config=ServerConfig(num_rounds=args.rounds, round_timeout=None))
    marks["done"] = time.monotonic()
    marks["vm_hwm"] = _vm_hwm()
    marks["torch_loaded"] = "torch" in sys.modules
    Path(args.out).write_text(json.dumps(marks))
    return 0


# --------------------------------------------------------------------------------------------- client process

def client_data(index: int) -> tuple[Any, Any]:
    """Client ``index``'s images and labels: round_overhead.py's ``write_data`` stream (seed 1, clients in turn)."""
    import numpy as np

    rng = np.random.default_rng(DATA_SEED)
    for _ in range(index + 1):
        x = rng.random((EXAMPLES, *IMAGE_SHAPE), dtype=np.float32)
        y = rng.integers(0, CLASSES, EXAMPLES)
    return x, y


def client_main(args: argparse.Namespace) -> int:
    """A Flower client: one SGD step on a batch of 8 per fit; writes its marks to ``out`` after its last fit
    (``rounds``) and again when the server ends."""
    started = time.monotonic()
    import numpy as np
    import torch
    from flwr.client import NumPyClient, start_client
    from torch.nn import functional as F

    torch.set_num_threads(1)
    model = build_mlp1()
    model.train()
    x_np, y_np = client_data(args.index)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    rng = np.random.default_rng(1000 + args.index)
    state = list(model.state_dict().values())  # views of the parameters, in the server's order
    fits: list[tuple[float, float, float]] = []  # (start, end, CPU seconds at the end) of each fit

    class StepClient(NumPyClient):  # type: ignore[misc]
        def get_parameters(self, config: dict[str, Any]) -> list[Any]:
            return [t.numpy() for t in state]

        def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
            t0 = time.monotonic()
            with torch.no_grad():
                for t, a in zip(state, parameters, strict=True):
                    t.copy_(torch.from_numpy(a))
            idx = torch.as_tensor(rng.permutation(EXAMPLES)[:BATCH])
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            # Views, no copy: Flower serialises them before the next message can arrive.
            out = [t.numpy() for t in state]
            fits.append((t0, time.monotonic(), _cpu_seconds()))
            if len(fits) == args.rounds:  # after the last fit's marks: no round pays for the write
                write_marks()
            return out, EXAMPLES, {}

    def write_marks() -> None:
        Path(args.out).write_text(json.dumps({"started": started, "ready": ready, "fits": fits, "vm_hwm": _vm_hwm()}))

    ready = time.monotonic()
    start_client(server_address=f"127.0.0.1:{args.port}", client=StepClient().to_client(), insecure=True,
                 transport="grpc-bidi", max_wait_time=LISTEN_TIMEOUT_S)
    write_marks()
    return 0


# --------------------------------------------------------------------------------------------- driver

def _child_env() -> dict[str, str]:
    """The children's environment: no telemetry, no proxy (loopback only), unbuffered logs."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy",
                                                                     "grpc_proxy")}
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    _CHILDREN.append(p)
    return p


def stop_children() -> None:
    """Terminate every child still running, then kill what has not exited within 5 s."""
    for p in _CHILDREN:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in _CHILDREN:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5.0)
    _CHILDREN.clear()


def _wait_listening(port: int, server: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the Flower server exited with {server.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"the Flower server did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def measure(clients: int, rounds: int, python: str, workdir: Path, timeout: float, max_workers: int) -> dict[str, Any]:
    """One Flower federation of ``clients`` clients for ``rounds`` rounds; returns the figures."""
    if rounds < 2:
        raise ValueError("--rounds must be at least 2 (the median is over rounds 2..R)")
    env = _child_env()
    script = str(Path(__file__).resolve())
    port = _free_port()
    server_out = workdir / "server.json"
    initial = workdir / "initial.npz"
    write_initial(initial)
    server = _spawn([python, script, "_server", "--port", str(port), "--clients", str(clients), "--rounds",
                     str(rounds), "--max-workers", str(max_workers), "--initial", str(initial), "--out",
                     str(server_out)],
                    workdir / "server.log", env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _wait_listening(port, server, LISTEN_TIMEOUT_S)
        spawned: list[float] = []
        for i in range(clients):
            spawned.append(time.monotonic())
            procs.append(_spawn([python, script, "_client", "--port", str(port), "--index", str(i), "--rounds",
                                 str(rounds), "--out", str(workdir / f"client-{i}.json")], workdir / f"client-{i}.log",
                                env))
        server_hwm = 0
        deadline = time.monotonic() + timeout
        while server.poll() is None:
            server_hwm = max(server_hwm, _vm_hwm(server.pid))
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"client {i} exited with {p.returncode}:\n{_tail(workdir / f'client-{i}.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the federation of {clients} did not finish within {timeout:.0f} s")
            time.sleep(POLL_SECONDS)
        if server.returncode != 0:
            raise RuntimeError(f"the Flower server exited with {server.returncode}:\n{_tail(workdir / 'server.log')}")
        exit_by = time.monotonic() + EXIT_TIMEOUT_S
        for i, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(exit_by - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                # Flower's client sometimes hangs in its shutdown after the server's Reconnect message. Its fits
                # are over and their marks written after the last one (checked below): it is stopped.
                if not (workdir / f"client-{i}.json").exists():
                    raise TimeoutError(f"client {i} did not exit {EXIT_TIMEOUT_S:.0f} s after the server") from None
                p.kill()
                p.wait()
                print(f"  (N={clients}: client {i} hung in Flower's shutdown after its last fit; stopped)",
                      file=sys.stderr)
                continue
            if rc != 0:
                raise RuntimeError(f"client {i} exited with {rc}:\n{_tail(workdir / f'client-{i}.log')}")
    finally:
        stop_children()
    s = json.loads(server_out.read_text())
    opened = {int(k): v for k, v in s["open"].items()}
    closed = {int(k): v for k, v in s["close"].items()}
    aggregating = {int(k): v for k, v in s["aggregate"].items()}
    cpu_close = {int(k): v for k, v in s["cpu_close"].items()}
    cl = [json.loads((workdir / f"client-{i}.json").read_text()) for i in range(clients)]
    if sorted(closed) != list(range(1, rounds + 1)) or any(len(c["fits"]) != rounds for c in cl):
        raise RuntimeError(f"expected {rounds} rounds, the server closed {sorted(closed)}, the clients fitted "
                           f"{sorted({len(c['fits']) for c in cl})}")
    durations = [closed[r] - closed[r - 1] for r in range(2, rounds + 1)]
    # CPU of rounds 2..R: the server between round 1's and round R's close, each client between the ends of
    # its fits of round 1 and round R (the same R-1 rounds of work, shifted by its upload's serialisation).
    server_cpu = cpu_close[rounds] - cpu_close[1]
    clients_cpu = sum(c["fits"][-1][2] - c["fits"][0][2] for c in cl)
    return {
        "framework": "flwr", "transport": "grpc-bidi", "clients": clients, "rounds": rounds,
        "round_median_s": statistics.median(durations),
        "round_p90_s": sorted(durations)[int(0.9 * (len(durations) - 1))],
        "round1_s": closed[1] - opened[1],
        "aggregate_median_s": statistics.median(closed[r] - aggregating[r] for r in range(2, rounds + 1)),
        "server_cpu_s_per_round": server_cpu / (rounds - 1),
        "cpu_s_per_round": (server_cpu + clients_cpu) / (rounds - 1),
        "server_peak_rss_mb": max(server_hwm, s["vm_hwm"]) / 2**20,
        "client_peak_rss_mb": max(c["vm_hwm"] for c in cl) / 2**20,
        "time_to_round1_s": opened[1] - spawned[0],
        "first_fit_s": max(c["fits"][0][0] - t for c, t in zip(cl, spawned, strict=True)),
        "import_s": max(c["ready"] - t for c, t in zip(cl, spawned, strict=True)),
        "payload_mb_per_round": 2 * clients * s["payload_bytes"] / 1e6,
        "server_max_workers": clients if max_workers == 0 else max_workers, "server_loaded_torch": s["torch_loaded"],
        "load_average": os.getloadavg()[0],
    }


HEADER = ("   N  round_s    p90_s    agg_s srvCPU_s allCPU_s srvRSS_MB cliRSS_MB  to_r1_s 1st_fit_s import_s  MB/round  load\n"
          "---- -------- -------- -------- -------- -------- --------- --------- -------- --------- -------- --------- -----")


def report(r: dict[str, Any]) -> str:
    """One row of the table."""
    return (f"{r['clients']:>4} {r['round_median_s']:8.3f} {r['round_p90_s']:8.3f} {r['aggregate_median_s']:8.3f} "
            f"{r['server_cpu_s_per_round']:8.3f} "
            f"{r['cpu_s_per_round']:8.3f} {r['server_peak_rss_mb']:9.0f} {r['client_peak_rss_mb']:9.0f} "
            f"{r['time_to_round1_s']:8.2f} {r['first_fit_s']:9.2f} {r['import_s']:8.2f} "
            f"{r['payload_mb_per_round']:9.2f} {r['load_average']:5.1f}")


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("flwr", "grpcio", "protobuf", "torch", "numpy"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} missing")
    return ", ".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each N and print one row each (or run as one of the federation's processes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_server", "_client"):
        role = argparse.ArgumentParser(prog=f"flower_round.py {argv[0]}")
        role.add_argument("--port", type=int, required=True)
        role.add_argument("--out", required=True)
        role.add_argument("--clients", type=int, default=0)
        role.add_argument("--rounds", type=int, default=0)
        role.add_argument("--max-workers", type=int, default=0)
        role.add_argument("--index", type=int, default=0)
        role.add_argument("--initial", default="")
        ns = role.parse_args(argv[1:])
        return server_main(ns) if argv[0] == "_server" else client_main(ns)
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--clients", default="4,8,32", help="comma-separated N")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per federation (the median is over 2..R)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of the server and client processes (default: this one; it needs flwr)")
    ap.add_argument("--max-workers", type=int, default=0,
                    help="the server's fit thread pool (default 0: one per client; Flower's own default is "
                         "min(32, cores + 4))")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one federation may take")
    ap.add_argument("--logs", type=Path, help="keep the processes' logs and marks under DIR/N (default: a "
                    "temporary folder, removed)")
    args = ap.parse_args(argv)
    # A SIGTERM (timeout, kill) stops the federation too: its clients would otherwise wait on a dead server.
    signal.signal(signal.SIGTERM, lambda signum, _frame: (stop_children(), sys.exit(128 + signum)))
    print(f"$ python benchmarks/flower_round.py {' '.join(argv)}")
    print(f"Flower legacy gRPC (grpc-bidi, start_server/start_client), FedAvg; workload A: MLP 784-1258-10 "
          f"({HETFED_MLP1_PARAMETERS:,} parameters), one SGD step of batch {BATCH} per round; {os.cpu_count()} "
          f"CPU cores; {_versions()}")
    print(HEADER, flush=True)
    rows = []
    try:
        for n in [int(x) for x in args.clients.split(",") if x]:
            if args.logs:
                (args.logs / str(n)).mkdir(parents=True, exist_ok=True)
                r = measure(n, args.rounds, args.python, args.logs / str(n), args.timeout, args.max_workers)
            else:
                with tempfile.TemporaryDirectory(prefix=f"flower-round-{n}-") as tmp:
                    r = measure(n, args.rounds, args.python, Path(tmp), args.timeout, args.max_workers)
            rows.append(r)
            print(report(r), flush=True)
    finally:
        stop_children()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
