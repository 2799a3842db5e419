"""Round overhead against its physical floor: real aggregator and client processes over loopback, FedAvg.

    python benchmarks/round_overhead.py --workload A --clients 4,8,16,32 --rounds 12
    python benchmarks/round_overhead.py --workload B --clients 4,8
    python benchmarks/round_overhead.py --workload A --clients 32,64 --light

Workloads (each organization's data is random 28x28 images in its own npz directory; torch clients use one
thread each; plaintext loopback; the aggregator fsyncs every accepted update, as always):

- A: a 1.0M-parameter MLP 784-1258-10 (``mlp1``, d_e = 1258), one SGD step on a batch of 8 per round;
- B: a 100k-parameter CNN conv16-conv32-fc60-fc10 (``cnn_small``), one epoch over 1,000 images, batch 32.

``--light`` replaces the torch clients by lightweight numpy clients speaking the same protocol through the
same typed client (several organizations per process, no training): they stand in for torch clients at large
N, and the output says so.

For each N it prints the round median (rounds 2..R; from the round's opening to its close), the period (from one
close to the next, read off the aggregator's log: what another framework's close-to-close round time compares
with), the aggregator's CPU seconds per round, the aggregator's
and one client's peak RSS, the bytes on the wire per round against the analytic payload 2·N·model bytes, and
the floor measured in the same run: the slowest organization's own training time per round (clients report
it with ``report_timing``) plus one loopback TCP copy of the round's bytes. The ratio round / floor is the
overhead, independent of how fast the machine is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.cli.localrun import LocalFederation, stop_all
from hetfed.wire.messages import RunStatus
from hetfed.wire.rpc import AggregatorClient

RUN = "overhead"
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Workload:
    """A model, how much local work a round does, and the data each organization holds."""

    name: str
    model: str
    latent_dim: int
    examples: int
    config: dict[str, Any]
    description: str


WORKLOADS = {
    "A": Workload("A", "mlp1", 1258, 64, {"local_steps": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.0},
                  "MLP 784-1258-10 (1.0M parameters), one SGD step of batch 8 per round"),
    "B": Workload("B", "cnn_small", 60, 1000, {"local_epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.0},
                  "CNN conv16-conv32-fc60-fc10 (100k parameters), one epoch over 1,000 images, batch 32"),
}


def model_shapes(w: Workload) -> dict[str, tuple[int, ...]]:
    """The float tensors FedAvg exchanges for the workload's model, by name (needs torch)."""
    from hetfed.client.models import build_model

    m = build_model(w.model, (1, 28, 28), 10, latent_dim=w.latent_dim)
    return {k: tuple(v.shape) for k, v in m.state_dict().items() if v.is_floating_point()}


def write_data(root: Path, w: Workload, clients: int, seed: int) -> list[Path]:
    """One npz directory of random images and labels per organization."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(clients):
        d = root / f"data-{i}"
        d.mkdir(parents=True, exist_ok=True)
        x = rng.random((w.examples, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, w.examples)
        np.savez(d / "train.npz", x=x, y=y)
        np.savez(d / "test.npz", x=x[:16], y=y[:16])
        out.append(d)
    return out


def plain_loop_seconds(w: Workload, epochs: int, device: str) -> float:
    """Median seconds of the workload's local training as a plain PyTorch loop (one process, one thread, no
    federation): the same model, data size, batch size and optimiser the clients use, timed per round's work."""
    import torch

    from hetfed.client.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    dev = torch.device(device)
    x = torch.from_numpy(rng.random((w.examples, 1, 28, 28), dtype=np.float32)).to(dev)
    y = torch.from_numpy(rng.integers(0, 10, w.examples)).to(dev)
    model = build_model(w.model, (1, 28, 28), 10, latent_dim=w.latent_dim).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=w.config["lr"], momentum=w.config["momentum"])
    batch = int(w.config["batch_size"])
    steps = int(w.config.get("local_steps", 0)) or -(-w.examples // batch) * int(w.config.get("local_epochs", 1))
    times = []
    for _ in range(epochs):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        perm = torch.randperm(w.examples, device=dev)
        for k in range(steps):
            idx = perm[(k * batch) % w.examples:(k * batch) % w.examples + batch]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:] if len(times) > 1 else times)


def loopback_copy_seconds(n_bytes: int, repeats: int = 3) -> float:
    """Median time to move ``n_bytes`` through a loopback TCP connection (send and receive everything)."""
    times = []
    for _ in range(repeats):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        def drain(srv: socket.socket = server) -> None:
            conn, _ = srv.accept()
            received = 0
            with conn:
                while received < n_bytes:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    received += len(chunk)

        t = threading.Thread(target=drain)
        t.start()
        payload = b"\0" * min(n_bytes, 64 << 20)
        with socket.create_connection(("127.0.0.1", port)) as c:
            start = time.perf_counter()
            sent = 0
            while sent < n_bytes:
                k = min(len(payload), n_bytes - sent)
                c.sendall(payload[:k])
                sent += k
            t.join()
            times.append(time.perf_counter() - start)
        server.close()
    return statistics.median(times)


# logging's timestamp at the start of every line the CLI logs (hetfed.cli's format), to the millisecond.
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def log_lines(log: Path, pattern: str) -> list[tuple[float, re.Match[str]]]:
    """(timestamp, match) of every line of a process's log whose text after the timestamp matches ``pattern``."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(_STAMP + pattern, line)
        if m:
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m))
    return out


def close_periods(log: Path, run: str) -> dict[int, float]:
    """Seconds from round r-1's close to round r's close, by r, from the aggregator's log (the period a client
    sees: opening, every client's round, the close and its aggregation; ``duration_seconds`` stops before the
    close's work). The close's log line is observe/observers.py's (engine.py's before the rooms)."""
    closes = {int(m.group(3)): t for t, m in log_lines(log, r"INFO \S+: run (\S+) closed train round (\d+) ")
              if m.group(2) == run}
    return {r: closes[r] - closes[r - 1] for r in sorted(closes) if r - 1 in closes}


def _proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak RSS bytes) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return cpu, hwm


def _cpu_or_none(pid: int) -> float | None:
    """CPU seconds of a process, None once it is gone."""
    try:
        return _proc_stat(pid)[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


class Probe:
    """Samples CPU once round 2 has begun and at the end of training (the aggregator's, and every process's: the
    aggregator and all client processes), and the processes' peak RSS.

    CPU per round is the CPU used between the two samples, over their interval, times the mean period (close to
    close) of rounds 2..R, so the samples need not fall on round boundaries; the driver polls Status every
    ``POLL_SECONDS`` over one channel, to stay out of the measurement.
    """

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.rss: dict[str, int] = {}
        self.client_cpu: dict[int, float] = {}  # each client process's CPU seconds at its last sample

    def sample(self, name: str, pid: int) -> None:
        try:
            _, hwm = _proc_stat(pid)
        except (FileNotFoundError, ProcessLookupError):
            return
        self.rss[name] = max(self.rss.get(name, 0), hwm)

    def __call__(self, agg_pid: int, client_pid: int | None, status: RunStatus, client_pids: Sequence[int] = ()) -> None:
        self.sample("aggregator", agg_pid)
        if client_pid is not None:
            self.sample("client", client_pid)
        cpu, _ = _proc_stat(agg_pid)
        starting = "start" not in self.marks and status.round >= 2 and status.phase.value == "train"
        ending = "start" in self.marks and "end" not in self.marks and status.phase.value != "train"
        for pid in client_pids:  # a process that has exited keeps its last reading
            seen = _cpu_or_none(pid)
            if seen is not None:
                self.client_cpu[pid] = seen
        if starting or ending:
            every = cpu + sum(self.client_cpu.values())
            mark = "start" if starting else "end"
            self.marks[mark], self.marks[f"{mark}_all"], self.marks[f"{mark}_t"] = cpu, every, time.monotonic()


def aggregator_config(w: Workload, clients: int, rounds: int, state: Path,
                      server: dict[str, Any] | None = None) -> dict[str, Any]:
    """One FedAvg run over every organization (``server``: [server] settings over the defaults)."""
    return {
        "server": {"listen": "127.0.0.1:0", "metrics_port": 0, "metrics_host": "127.0.0.1", "state_dir": str(state),
                   **(server or {})},
        "runs": [{"id": RUN, "algorithm": "fedavg", "organizations": [f"org-{i}" for i in range(clients)],
                  "rounds": rounds, "seed": 0, "algorithm_config": w.config}],
    }


def client_config(w: Workload, i: int, port: int, data: Path, device: str = "cpu",
                  state_dir: Path | None = None) -> dict[str, Any]:
    """A torch client of the workload (``state_dir``: it keeps its state there, as a deployed client does)."""
    cfg = {"organization": f"org-{i}", "run": RUN, "aggregator": f"127.0.0.1:{port}", "device": device,
           "threads": 1, "report_timing": True, "data": {"dataset": "npz", "partition": "natural", "path": str(data)},
           "model": {"name": w.model, "latent_dim": w.latent_dim}, "retry": {"give_up_after_seconds": 300.0}}
    if state_dir is not None:
        cfg["state_dir"] = str(state_dir)
    return cfg


def light_command(port: int, organizations: list[str], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """A process of lightweight numpy clients (benchmarks/light_clients.py)."""
    return [sys.executable, str(Path(__file__).with_name("light_clients.py")), "--aggregator", f"127.0.0.1:{port}",
            "--run", RUN, "--organizations", ",".join(organizations), "--shapes", json.dumps(shapes)]


def measure(w: Workload, clients: int, rounds: int, light: bool, workdir: Path, per_process: int,
            device: str = "cpu", server: dict[str, Any] | None = None, client_state: bool = False) -> dict[str, Any]:
    """One federation of ``clients`` organizations for ``rounds`` rounds; returns the figures (``client_state``:
    each torch client keeps a state directory)."""
    shapes = model_shapes(w)
    model_bytes = sum(int(np.prod(s)) * 4 for s in shapes.values())
    fed = LocalFederation(workdir)
    probe = Probe()
    light_procs: list[subprocess.Popen[bytes]] = []
    try:
        fed.start_aggregator(aggregator_config(w, clients, rounds, workdir / "state", server))
        assert fed.aggregator is not None
        if light:
            orgs = [f"org-{i}" for i in range(clients)]
            for k in range(0, clients, per_process):
                log = open(workdir / f"light-{k}.log", "wb")  # noqa: SIM115 - owned by the child
                light_procs.append(subprocess.Popen(light_command(fed.port, orgs[k:k + per_process], shapes),
                                                    stdout=log, stderr=subprocess.STDOUT, env=fed.env))
        else:
            for i, data in enumerate(write_data(workdir, w, clients, seed=1)):
                state_dir = workdir / f"client-{i}-state" if client_state else None
                fed.start_client(f"client-{i}", client_config(w, i, fed.port, data, device, state_dir))
        first = light_procs[0] if light else fed.clients["client-0"]
        deadline = time.monotonic() + 3600
        with AggregatorClient(f"127.0.0.1:{fed.port}", None, "", "", call_timeout=30.0) as watcher:
            while True:
                fed.raise_if_failed()
                for p in light_procs:
                    if p.poll() not in (None, 0):
                        raise RuntimeError(f"a light client process exited with {p.returncode}")
                (status,) = watcher.status(RUN)
                probe(fed.aggregator.pid, first.pid if first.poll() is None else None, status,
                      [p.pid for p in light_procs] if light else [c.pid for c in fed.clients.values()])
                if status.finished:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the federation did not finish within an hour")
                time.sleep(POLL_SECONDS)
        probe.sample("aggregator", fed.aggregator.pid)
    finally:
        for p in light_procs:
            if p.poll() is None:
                p.terminate()
        fed.stop()
    train = [h for h in status.history if 2 <= h.round <= rounds]
    durations = [h.duration_seconds for h in train]
    periods = [v for r, v in close_periods(workdir / "aggregator.log", RUN).items() if 2 <= r <= rounds]
    round_bytes = statistics.median(sum(t.bytes for t in h.traffic) for h in train)
    # The floor: the slowest organization's own training time in each round, plus one loopback copy.
    train_wall = []
    prev: dict[str, float] = {}
    for h in status.history:
        per_org = {o: m.extra.get("train_wall_seconds") for o, m in h.reports.items()}
        if 2 <= h.round <= rounds and prev and all(v is not None for v in per_org.values()):
            train_wall.append(max(v - prev.get(o, 0.0) for o, v in per_org.items()))  # type: ignore[operator]
        prev = {o: v for o, v in per_org.items() if v is not None}
    copy = loopback_copy_seconds(int(round_bytes))
    training = statistics.median(train_wall) if train_wall else 0.0
    floor = training + copy
    median = statistics.median(durations)
    window = probe.marks.get("end_t", 0.0) - probe.marks.get("start_t", 0.0)
    # A round's share of the window: its mean period, close to close (the mean open-to-close duration, which
    # leaves the close out, where the log has no closes).
    per_round = statistics.fmean(periods) if periods else statistics.fmean(durations)
    agg_cpu = ((probe.marks["end"] - probe.marks["start"]) / window * per_round
               if window > 0 else float("nan"))
    all_cpu = ((probe.marks["end_all"] - probe.marks["start_all"]) / window * per_round
               if window > 0 else float("nan"))
    return {
        "workload": w.name, "clients": clients, "rounds": rounds, "light_clients": light, "device": device,
        "round_median_s": median, "round_p90_s": sorted(durations)[int(0.9 * (len(durations) - 1))],
        # Close to close (the round's aggregation included), as a federation's throughput is counted elsewhere.
        "period_median_s": statistics.median(periods) if periods else float("nan"),
        "aggregator_cpu_s_per_round": agg_cpu,
        # Every process of the federation (the aggregator and its clients): core-seconds per round.
        "cpu_s_per_round": all_cpu,
        "aggregator_peak_rss_mb": probe.rss.get("aggregator", 0) / 2**20,
        "client_peak_rss_mb": probe.rss.get("client", 0) / 2**20,
        "bytes_per_round": round_bytes, "analytic_bytes_per_round": 2 * clients * model_bytes,
        "training_s": training, "loopback_copy_s": copy, "floor_s": floor,
        "overhead_ratio": median / floor if floor > 0 else float("nan"),
        "load_average": os.getloadavg()[0],
    }


def report(r: dict[str, Any]) -> str:
    """One row of the table."""
    return (f"{r['workload']:>2} {r['clients']:>4}{'*' if r['light_clients'] else ' '} {r['round_median_s']:8.3f} "
            f"{r['round_p90_s']:8.3f} {r['period_median_s']:8.3f} {r['aggregator_cpu_s_per_round']:8.3f} "
            f"{r['cpu_s_per_round']:8.3f} "
            f"{r['aggregator_peak_rss_mb']:8.0f} "
            f"{r['client_peak_rss_mb']:8.0f} {r['bytes_per_round'] / 1e6:9.2f} "
            f"{r['bytes_per_round'] / r['analytic_bytes_per_round']:7.4f} {r['training_s']:8.3f} "
            f"{r['loopback_copy_s']:8.3f} {r['overhead_ratio']:7.2f} {r['load_average']:5.1f}")


HEADER = (" W    N  round_s   p90_s period_s aggCPU_s allCPU_s aggRSS_MB cliRSS_MB  MB/round  /payload  train_s   copy_s  ratio  load\n"
          "-- ----- -------- -------- -------- -------- -------- -------- -------- --------- ------- -------- -------- ------- -----")


def main(argv: list[str] | None = None) -> int:
    """Measure each N and print one row each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="A")
    ap.add_argument("--clients", default="4,8,16,32", help="comma-separated N")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per federation (the median is over 2..R)")
    ap.add_argument("--light", action="store_true", help="lightweight numpy clients instead of torch clients")
    ap.add_argument("--per-process", type=int, default=16, help="light clients per process")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--device", default="cpu", help="the torch clients' device: cpu (default), cuda or cuda:N")
    ap.add_argument("--plain", action="store_true",
                    help="also time the same training as a plain PyTorch loop (one process, no federation) on the "
                         "clients' device, and print each round median against it")
    ap.add_argument("--server", action="append", default=[], metavar="KEY=VALUE",
                    help="an aggregator [server] setting instead of its default (a JSON value), e.g. "
                         "--server stream_window_bytes=0; repeatable")
    ap.add_argument("--client-state", action="store_true",
                    help="give each torch client a state directory, as a deployed client has (its private state "
                         "saved after each round, its push kept until acknowledged)")
    args = ap.parse_args(argv)
    # A SIGTERM (timeout, kill) stops the federation it started too: its clients would otherwise retry
    # against a dead aggregator for minutes, loading the machine the next measurement runs on.
    signal.signal(signal.SIGTERM, lambda signum, _frame: (stop_all(), sys.exit(128 + signum)))
    w = WORKLOADS[args.workload]
    server = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.server)}
    print(f"$ python benchmarks/round_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"workload {w.name}: {w.description}; {'lightweight numpy clients (*)' if args.light else 'torch clients'}; "
          f"{os.cpu_count()} CPU cores; clients on {args.device}")
    print(HEADER, flush=True)
    rows = []
    for n in [int(x) for x in args.clients.split(",") if x]:
        with tempfile.TemporaryDirectory(prefix=f"hetfed-overhead-{n}-") as tmp:
            r = measure(w, n, args.rounds, args.light, Path(tmp), args.per_process, args.device, server,
                        args.client_state)
        rows.append(r)
        print(report(r), flush=True)
    if args.plain and not args.light:
        import torch

        device = args.device
        plain = plain_loop_seconds(w, args.rounds, device)
        print(f"plain PyTorch loop of the same training on {device} ({torch.cuda.get_device_name(torch.device(device)) if device.startswith('cuda') else 'CPU'}), "
              f"median of {args.rounds - 1} rounds' work after a warm-up: {plain:.4f} s")
        for r in rows:
            r["plain_loop_s"], r["plain_device"] = plain, device
            print(f"  N={r['clients']}: round median {r['round_median_s']:.4f} s = {r['round_median_s'] / plain:.3f}x the "
                  f"plain loop (clients' own training {r['training_s']:.4f} s = {r['training_s'] / plain:.3f}x)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
