"""The floor of a FedAvg round over gRPC in Python: workload A with nothing but the bytes and the step.

    python benchmarks/grpc_round_floor.py --clients 4,8,32 --rounds 12
    python scripts/bench_flower.py --flower-python "$FLWR_VENV/bin/python" --floor --clients 4,8,32

A bound, not a framework: how short a round of ``round_overhead.py``'s workload A can be on this machine when
the model goes to every client and back over grpcio, and nothing else happens. hetfed's round and Flower's
(``flower_round.py``) both move these bytes; whatever either does beyond them shows as its distance from here.

One server process and N client processes on loopback, plaintext. The transport is hetfed's own:
``hetfed.wire.transport.make_server`` (an asyncio server with the aggregator's default 64 KiB stream window) and
``make_channel`` (a synchronous channel on its own TCP connection), with the aggregator's 1 MiB chunks.
Requests and responses are raw bytes: no Protobuf, no digest, no framing, no checks, no durability, no metrics.

- A client long-polls ``Pull`` with the round it wants and receives the global model as 1 MiB chunks of its
  float32 bytes. It copies them into its model, takes one SGD step on a batch of 8 (``flower_round.py``'s client
  step: the same model, data, seeds, learning rate and fresh optimiser) and streams its weights back in 1 MiB
  chunks on ``Push``.
- The server adds each update into a float32 sum (every client holds 64 examples: equal weights). After the
  N-th it divides, cuts the new model into chunks and opens the next round. It never imports torch.

Figures per N, as ``flower_round.py`` reads them (one table row, one JSON row with ``--json``):
``round_median_s``, the median over rounds 2..R of the time between consecutive closes (server clock);
``cpu_s_per_round``, every process's user+system CPU over rounds 2..R (the server between round 1's and round
R's close, each client between the ends of its rounds 1 and R) over R-1; ``server_cpu_s_per_round``;
``server_peak_rss_mb`` and ``client_peak_rss_mb`` (VmHWM).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Workload A, as flower_round.py defines it for both frameworks (this folder is first on sys.path when run).
from flower_round import (
    BATCH,
    EXAMPLES,
    HETFED_MLP1_SHAPES,
    LR,
    MOMENTUM,
    _child_env,
    _cpu_seconds,
    _spawn,
    _tail,
    _vm_hwm,
    build_mlp1,
    client_data,
    stop_children,
    write_initial,
)

SERVICE = "floor.Round"
POLL_SECONDS = 0.2
START_TIMEOUT_S = 120.0


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


# --------------------------------------------------------------------------------------------- server process

def server_main(args: argparse.Namespace) -> int:
    """Serve R rounds to N clients, then write the marks and exit."""
    import grpc

    from hetfed.aggregator.config import ServerConfig
    from hetfed.wire.chunks import DEFAULT_CHUNK_BYTES
    from hetfed.wire.transport import make_server

    with np.load(args.initial) as npz:
        model = np.concatenate([npz[k].ravel() for k in HETFED_MLP1_SHAPES]).astype(np.float32)
    marks: dict[str, Any] = {"close": [], "cpu_close": [], "payload_bytes": model.nbytes}

    async def serve() -> None:
        server, port = make_server("127.0.0.1:0", None, ServerConfig().stream_window_bytes)
        opened = asyncio.Condition()
        state: dict[str, Any] = {"round": 1, "chunks": _chunks(model.tobytes(), DEFAULT_CHUNK_BYTES),
                                 "sum": None, "received": 0}
        finished = asyncio.Event()

        async def pull(request: bytes, context: Any) -> AsyncIterator[bytes]:
            wanted = int.from_bytes(request, "little")
            async with opened:
                await opened.wait_for(lambda: state["round"] >= wanted)
                chunks = state["chunks"]
            for chunk in chunks:
                yield chunk

        async def push(requests: AsyncIterator[bytes], context: Any) -> bytes:
            update = np.frombuffer(b"".join([chunk async for chunk in requests]), np.float32)
            if state["sum"] is None:
                state["sum"] = update.copy()
            else:
                state["sum"] += update
            state["received"] += 1
            if state["received"] == args.clients:
                mean = state["sum"] / np.float32(args.clients)
                state["sum"], state["received"] = None, 0
                marks["close"].append(time.monotonic())
                marks["cpu_close"].append(_cpu_seconds())
                async with opened:
                    state["chunks"] = _chunks(mean.tobytes(), DEFAULT_CHUNK_BYTES)
                    state["round"] += 1
                    opened.notify_all()
                if len(marks["close"]) == args.rounds:
                    finished.set()
            return b""

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "Push": grpc.stream_unary_rpc_method_handler(push),
        }),))
        await server.start()
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(args.port_file)
        await finished.wait()
        await server.stop(grace=5.0)

    asyncio.run(serve())
    marks["vm_hwm"] = _vm_hwm()
    marks["torch_loaded"] = "torch" in sys.modules
    Path(args.out).write_text(json.dumps(marks))
    return 0


# --------------------------------------------------------------------------------------------- client process

def client_main(args: argparse.Namespace) -> int:
    """R rounds of pull, one step, push; writes the CPU mark at the end of each round."""
    import warnings

    import torch
    from torch.nn import functional as F

    from hetfed.wire.chunks import DEFAULT_CHUNK_BYTES
    from hetfed.wire.transport import make_channel

    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
    torch.set_num_threads(1)
    model = build_mlp1()
    model.train()
    x_np, y_np = client_data(args.index)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    rng = np.random.default_rng(1000 + args.index)
    state = list(model.state_dict().values())  # views of the parameters, in the server's order
    channel = make_channel(f"127.0.0.1:{args.port}", None)
    pull = channel.unary_stream(f"/{SERVICE}/Pull")
    push = channel.stream_unary(f"/{SERVICE}/Push")
    ends: list[float] = []
    for r in range(1, args.rounds + 1):
        received = np.frombuffer(b"".join(pull(r.to_bytes(8, "little"), timeout=600)), np.float32)
        flat = torch.from_numpy(received)  # read-only: only copied from, once, into the model
        offset = 0
        with torch.no_grad():
            for t in state:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        idx = torch.as_tensor(rng.permutation(EXAMPLES)[:BATCH])
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        update = b"".join(memoryview(t.detach().numpy()).cast("B") for t in state)
        push(iter(_chunks(update, DEFAULT_CHUNK_BYTES)), timeout=600)
        ends.append(_cpu_seconds())
    channel.close()
    Path(args.out).write_text(json.dumps({"cpu_ends": ends, "vm_hwm": _vm_hwm()}))
    return 0


# --------------------------------------------------------------------------------------------- driver

def measure(clients: int, rounds: int, workdir: Path, timeout: float) -> dict[str, Any]:
    """One federation of ``clients`` for ``rounds`` rounds; its figures."""
    if rounds < 2:
        raise ValueError("--rounds must be at least 2 (the median is over rounds 2..R)")
    env = _child_env()
    script = str(Path(__file__).resolve())
    initial, port_file, server_out = workdir / "initial.npz", workdir / "port", workdir / "server.json"
    write_initial(initial)
    logs = [workdir / "server.log", *(workdir / f"client-{i}.log" for i in range(clients))]

    def check(procs: list[subprocess.Popen[bytes]]) -> None:
        for p, log in zip(procs, logs, strict=True):
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{log.stem} exited with {p.returncode}:\n{_tail(log)}")

    try:
        server = _spawn([sys.executable, script, "_server", "--clients", str(clients), "--rounds", str(rounds),
                         "--initial", str(initial), "--port-file", str(port_file), "--out", str(server_out)],
                        logs[0], env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the floor server did not start:\n{_tail(logs[0])}")
            time.sleep(0.05)
        port = port_file.read_text()
        procs = [server, *(_spawn([sys.executable, script, "_client", "--port", port, "--index", str(i), "--rounds",
                                   str(rounds), "--out", str(workdir / f"client-{i}.json")], logs[i + 1], env)
                           for i in range(clients))]
        server_hwm = 0
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            server_hwm = max(server_hwm, _vm_hwm(server.pid))
            check(procs)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the federation of {clients} did not finish within {timeout:.0f} s")
            time.sleep(POLL_SECONDS)
        check(procs)
    finally:
        stop_children()
    s = json.loads(server_out.read_text())
    cl = [json.loads((workdir / f"client-{i}.json").read_text()) for i in range(clients)]
    closes, cpu_close = s["close"], s["cpu_close"]
    if len(closes) != rounds or any(len(c["cpu_ends"]) != rounds for c in cl):
        raise RuntimeError(f"expected {rounds} rounds: the server closed {len(closes)}")
    durations = [b - a for a, b in itertools.pairwise(closes)]
    server_cpu = cpu_close[-1] - cpu_close[0]
    clients_cpu = sum(c["cpu_ends"][-1] - c["cpu_ends"][0] for c in cl)
    return {
        "framework": "grpc-floor", "clients": clients, "rounds": rounds,
        "round_median_s": statistics.median(durations),
        "round_p90_s": sorted(durations)[int(0.9 * (len(durations) - 1))],
        "server_cpu_s_per_round": server_cpu / (rounds - 1),
        "cpu_s_per_round": (server_cpu + clients_cpu) / (rounds - 1),
        "server_peak_rss_mb": max(server_hwm, s["vm_hwm"]) / 2**20,
        "client_peak_rss_mb": max(c["vm_hwm"] for c in cl) / 2**20,
        "payload_mb_per_round": 2 * clients * s["payload_bytes"] / 1e6,
        "server_loaded_torch": s["torch_loaded"],
        "load_average": os.getloadavg()[0],
    }


HEADER = ("   N  round_s    p90_s srvCPU_s allCPU_s srvRSS_MB cliRSS_MB  MB/round  load\n"
          "---- -------- -------- -------- -------- --------- --------- --------- -----")


def report(r: dict[str, Any]) -> str:
    """One row of the table."""
    return (f"{r['clients']:>4} {r['round_median_s']:8.3f} {r['round_p90_s']:8.3f} {r['server_cpu_s_per_round']:8.3f} "
            f"{r['cpu_s_per_round']:8.3f} {r['server_peak_rss_mb']:9.0f} {r['client_peak_rss_mb']:9.0f} "
            f"{r['payload_mb_per_round']:9.2f} {r['load_average']:5.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each N and print one row each (or run as one of the federation's processes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_server", "_client"):
        role = argparse.ArgumentParser(prog=f"grpc_round_floor.py {argv[0]}")
        role.add_argument("--rounds", type=int, required=True)
        role.add_argument("--out", required=True)
        if argv[0] == "_server":
            role.add_argument("--clients", type=int, required=True)
            role.add_argument("--initial", required=True)
            role.add_argument("--port-file", required=True)
            return server_main(role.parse_args(argv[1:]))
        role.add_argument("--port", type=int, required=True)
        role.add_argument("--index", type=int, required=True)
        return client_main(role.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="4", help="comma-separated N (default 4)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per federation (the median is over 2..R)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one federation may take")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/grpc_round_floor.py --clients {args.clients} --rounds {args.rounds}")
    print("workload A over grpcio with nothing but the bytes and the step; "
          f"{os.cpu_count()} CPU cores\n{HEADER}", flush=True)
    rows = []
    for n in (int(v) for v in args.clients.split(",")):
        with tempfile.TemporaryDirectory(prefix=f"hetfed-floor-{n}-") as tmp:
            row = measure(n, args.rounds, Path(tmp), args.timeout)
        rows.append(row)
        print(report(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
