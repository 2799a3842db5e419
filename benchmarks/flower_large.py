"""Flower 1.42 on benchmarks/large_model.py's synthetic model: the server's peak RSS and round, beside hetfed's.

A comparison harness that runs in Flower's virtual environment (benchmarks/flower_round.py's docstring says how
to make it; torch is not needed here), importing no hetfed module::

    $FLWR_VENV/bin/python benchmarks/flower_large.py --size-gb 0.4 --clients 4 --rounds 3 --max-total-gb 8
    python benchmarks/large_model.py --size-gb 0.4 --clients 4 --flower-python $FLWR_VENV/bin/python

The model is benchmarks/synthetic_model.py's GPT-2-Large-like list of float32 tensors of the declared size,
the same list hetfed's side federates. One Flower server process (``start_server``, legacy gRPC "grpc-bidi",
a ``FedAvg`` strategy with fraction_fit 1, fraction_evaluate 0, in-place aggregation, initial parameters the
model's base values, one worker thread per client, gRPC's message limit raised to 2 GiB - 1 so that the model
fits in one message as far as Protobuf allows) and N client processes (``start_client`` with a
``NumPyClient``) whose ``fit`` trains nothing: it returns the update hetfed's synthetic client of the same index
sends in that round (base values plus seeded noise, built whole, as a NumPyClient must), with the same
example count.

Figures (one row, and one JSON row with ``--json``, in large_model.py's fields): ``round_s``, the median over
rounds 2..R of the time between consecutive rounds' closes (the return of ``aggregate_fit``, in the server);
``agg_cpu_s`` and ``clients_cpu_s``, core-seconds per round between the closes (the clients' between the ends of
their first and last fits); ``agg_peak_rss_gb``, the server's VmHWM (read by the server at the end and by this
driver every 50 ms, the larger); ``client_peak_rss_gb``, the largest client's. A memory guard stops the
federation when the machine's available memory falls under ``--guard-gb`` (default 3) or the federation's
processes hold more than ``--max-total-gb`` together; the row then reads "stopped at X GB in round R".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import flower_round as fr
import synthetic_model as synth

SAMPLE_S = 0.05
MAX_MESSAGE = (1 << 31) - 1
EXAMPLES = 1000


def _status(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process in bytes, zeros once it is gone."""
    hwm = rss = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return hwm, rss


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def server_main(args: argparse.Namespace) -> int:
    """The Flower server: FedAvg over the synthetic model; writes its marks to ``out`` as rounds open and close."""
    from flwr.common import ndarrays_to_parameters
    from flwr.server import Server, ServerConfig, SimpleClientManager, start_server
    from flwr.server.strategy import FedAvg

    marks: dict[str, Any] = {"open": {}, "close": {}, "cpu_close": {}}
    out = Path(args.out)

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(marks))
        tmp.replace(out)

    class TimedFedAvg(FedAvg):  # type: ignore[misc]
        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            instructions = super().configure_fit(server_round, parameters, client_manager)
            marks["open"][server_round] = time.monotonic()
            save()
            return instructions

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            if failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} failed clients: {failures[:3]}")
            result = super().aggregate_fit(server_round, results, failures)
            marks["close"][server_round] = time.monotonic()
            marks["cpu_close"][server_round] = fr._cpu_seconds()
            save()
            return result

    shapes = synth.model_shapes(int(args.size_gb * 1e9))
    initial = ndarrays_to_parameters([synth.base_tensor(shapes, k, args.seed) for k in shapes])
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=args.clients,
                           min_evaluate_clients=args.clients, min_available_clients=args.clients,
                           initial_parameters=initial, accept_failures=False, inplace=True,
                           fit_metrics_aggregation_fn=lambda _metrics: {})
    del initial
    server = Server(client_manager=SimpleClientManager(), strategy=strategy)
    server.set_max_workers(args.clients)
    start_server(server_address=f"127.0.0.1:{args.port}", server=server, grpc_max_message_length=MAX_MESSAGE,
                 config=ServerConfig(num_rounds=args.rounds, round_timeout=None))
    marks["vm_hwm"] = fr._vm_hwm()
    save()
    return 0


def client_main(args: argparse.Namespace) -> int:
    """A Flower client whose fit returns the synthetic update of its index and round."""
    from flwr.client import NumPyClient, start_client

    shapes = synth.model_shapes(int(args.size_gb * 1e9))
    fits: list[tuple[float, float]] = []  # (end, CPU seconds at the end) of each fit

    class SyntheticClient(NumPyClient):  # type: ignore[misc]
        def get_parameters(self, config: dict[str, Any]) -> list[Any]:
            return [synth.base_tensor(shapes, k, args.seed) for k in shapes]

        def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
            if [tuple(p.shape) for p in parameters] != list(shapes.values()):
                raise ValueError("the server sent other shapes than the model's")
            del parameters
            round_ = len(fits) + 1
            out = [synth.update_tensor(shapes, k, args.seed, args.index, round_) for k in shapes]
            fits.append((time.monotonic(), fr._cpu_seconds()))
            Path(args.out).write_text(json.dumps({"fits": fits, "vm_hwm": fr._vm_hwm()}))
            return out, EXAMPLES, {}

    start_client(server_address=f"127.0.0.1:{args.port}", client=SyntheticClient().to_client(), insecure=True,
                 transport="grpc-bidi", grpc_max_message_length=MAX_MESSAGE, max_wait_time=fr.LISTEN_TIMEOUT_S)
    Path(args.out).write_text(json.dumps({"fits": fits, "vm_hwm": fr._vm_hwm()}))
    return 0


def _read(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def measure(size_gb: float, clients: int, rounds: int, workdir: Path, guard: tuple[float, float],
            seed: int = 0, timeout: float = 7200.0) -> dict[str, Any]:
    """One Flower federation; returns large_model.py's fields (or the guard's "stopped at")."""
    shapes = synth.model_shapes(int(size_gb * 1e9))
    model = synth.model_bytes(shapes)
    row: dict[str, Any] = {"system": "Flower", "size_gb": size_gb, "model_bytes": model, "clients": clients,
                           "rounds": rounds, "rtt_ms": 0.0, "mbit": 0.0, "stopped": ""}
    env, script, port = fr._child_env(), str(Path(__file__).resolve()), fr._free_port()
    common = ["--port", str(port), "--size-gb", f"{size_gb:g}", "--rounds", str(rounds), "--clients",
              str(clients), "--seed", str(seed)]
    server = fr._spawn([sys.executable, script, "_server", *common, "--out", str(workdir / "server.json")],
                       workdir / "server.log", env)
    hwm = dict.fromkeys(["server", *(f"client-{i}" for i in range(clients))], 0)
    try:
        fr._wait_listening(port, server, fr.LISTEN_TIMEOUT_S)
        procs = [fr._spawn([sys.executable, script, "_client", *common, "--index", str(i), "--out",
                            str(workdir / f"client-{i}.json")], workdir / f"client-{i}.log", env)
                 for i in range(clients)]
        pids = {"server": server.pid, **{f"client-{i}": p.pid for i, p in enumerate(procs)}}
        deadline = time.monotonic() + timeout
        while server.poll() is None:
            held = 0
            for name, pid in pids.items():
                peak, now = _status(pid)
                hwm[name] = max(hwm[name], peak)
                held += now
            available = _available()
            if available < guard[0] * 1e9 or (guard[1] and held > guard[1] * 1e9):
                opened = _read(workdir / "server.json").get("open", {})
                row["stopped"] = (f"stopped at {held / 1e9:.1f} GB in round {max(map(int, opened), default=1)} "
                                  f"(available {available / 1e9:.1f} GB)")
                break
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"client {i} exited with {p.returncode}:\n{fr._tail(workdir / f'client-{i}.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the federation did not finish within {timeout:.0f} s")
            time.sleep(SAMPLE_S)
        if not row["stopped"] and server.returncode != 0:
            raise RuntimeError(f"the Flower server exited with {server.returncode}:\n{fr._tail(workdir / 'server.log')}")
    finally:
        fr.stop_children()
    s = _read(workdir / "server.json")
    cl = [_read(workdir / f"client-{i}.json") for i in range(clients)]
    server_hwm = max(hwm["server"], s.get("vm_hwm", 0))
    row.update(agg_peak_rss_gb=server_hwm / 1e9, agg_rss_over_model=server_hwm / model,
               client_peak_rss_gb=max(max(hwm[f"client-{i}"], c.get("vm_hwm", 0)) for i, c in enumerate(cl)) / 1e9)
    if row["stopped"]:
        return row
    closed = {int(k): v for k, v in s["close"].items()}
    cpu = {int(k): v for k, v in s["cpu_close"].items()}
    if sorted(closed) != list(range(1, rounds + 1)) or any(len(c["fits"]) != rounds for c in cl):
        raise RuntimeError(f"expected {rounds} rounds; the server closed {sorted(closed)}")
    row.update(round_s=statistics.median(closed[r] - closed[r - 1] for r in range(2, rounds + 1)),
               agg_cpu_s=(cpu[rounds] - cpu[1]) / (rounds - 1),
               clients_cpu_s=sum(c["fits"][-1][1] - c["fits"][0][1] for c in cl) / (rounds - 1),
               load_average=os.getloadavg()[0])
    return row


def main(argv: list[str] | None = None) -> int:
    """Measure each (size, N), or run as one of the federation's processes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-gb", default="0.4")
    ap.add_argument("--clients", default="4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--guard-gb", type=float, default=3.0)
    ap.add_argument("--max-total-gb", type=float, default=0.0)
    ap.add_argument("--json", type=Path)
    if argv and argv[0] in ("_server", "_client"):
        ap.add_argument("--port", type=int, required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--index", type=int, default=0)
        ns = ap.parse_args(argv[1:])
        ns.size_gb, ns.clients = float(ns.size_gb), int(ns.clients)
        return server_main(ns) if argv[0] == "_server" else client_main(ns)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2 (the median is over rounds 2..R)")
    signal.signal(signal.SIGTERM, lambda signum, _frame: (fr.stop_children(), sys.exit(128 + signum)))
    print(f"$ python benchmarks/flower_large.py {' '.join(argv)}")
    print(f"Flower legacy gRPC (grpc-bidi), FedAvg, synthetic model; {os.cpu_count()} CPU cores; {fr._versions()}")
    rows = []
    for size in [float(x) for x in args.size_gb.split(",") if x]:
        for n in [int(x) for x in args.clients.split(",") if x]:
            with tempfile.TemporaryDirectory(prefix=f"flower-large-{size:g}-{n}-") as tmp:
                r = measure(size, n, args.rounds, Path(tmp), (args.guard_gb, args.max_total_gb), args.seed)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
