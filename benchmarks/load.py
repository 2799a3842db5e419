"""Load: one aggregator and up to a thousand concurrent lightweight clients speaking the real protocol.

    python benchmarks/load.py                                  # 1,000 clients in 4 processes, 4 model sizes
    python benchmarks/load.py --clients 200 --dims 256,4096    # smaller

A real ``hetfed aggregator`` process hosts one FedAvg run per model size (``--dims`` float32 elements) whose
rounds close when every client has pushed. Client processes (``--processes``) each run their share of the
clients as asyncio tasks, one gRPC channel (one TCP connection) per client, on loopback: join with the
declared tensor, long-poll, push a deterministic update of the model they received, until the run finishes.
Every client is numpy only; nothing simulates the wire.

Measured, while the runs go: round time (from the aggregator's round records, rounds 2.. of each run, which
start when the previous round closes) against the bytes the round moved (both directions, as the aggregator
counted them), with a least-squares line; a health check every 50 ms from this process, on the health listener
the kubelet's probes call (``probe_*``) and on the serving port (``health_*``): latency, and how many took
over 100 ms; the aggregator's thread count and RSS every 0.5 s, first with ``--few`` clients, then with
all of them. The machine's load average is printed at the start and the end: the figures depend on it. On a
small machine the client processes compete with the aggregator for the same cores (in a deployment they run
elsewhere); ``--client-nice 10`` lowers their priority so the aggregator is measured, not the scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks, codec, messages
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind, Received
from hetfed.wire.phases import Action
from hetfed.wire.rpc import status_of
from hetfed.wire.specs import get_spec
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, OWN_CONNECTION

SPEC = get_spec("fedavg")
ROUNDS = 3


# ================================================================================================ client processes


async def one_client(address: str, run_id: str, org: str, dim: int, timeout: float) -> int:
    """One organization's client until its run finishes; returns the rounds it pushed."""
    md = ((ORGANIZATION_METADATA_KEY, org),)
    pushed = 0
    async with grpc.aio.insecure_channel(address, options=[OWN_CONNECTION]) as channel:
        stub = agrpc.AggregatorStub(channel)
        join = apb.JoinRequest(run_id=run_id, organization_id=org, num_train_examples=10)
        join.declared_tensors.add(payload_kind=PayloadKind.MODEL_WEIGHTS.proto_enum, name="w",  # type: ignore[arg-type]
                                  dtype=codec.dtype_enum("float32"), shape=[dim])  # type: ignore[arg-type]
        await retry(lambda: stub.Join(join, metadata=md, timeout=60))
        completed = -1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            req = apb.PullInstructionsRequest(run_id=run_id, organization_id=org, completed_round=completed,
                                              wait_seconds=20.0)

            async def pull(req: apb.PullInstructionsRequest = req) -> bytes:
                asm = chunks.Reassembler(1 << 32)
                async for resp in stub.PullInstructions(req, metadata=md, timeout=80):
                    asm.add(resp.chunk)
                return asm.data()

            ins, _ = messages.decode_instructions(await retry(pull), SPEC)
            if ins.action is Action.WAIT:
                continue
            if ins.action is Action.FINISH:
                return pushed
            mw = Received(ins.payloads).maybe(ModelWeights)
            base = np.zeros(dim, np.float32) if mw is None else mw.tensors["w"]
            report = EvalMetrics(test_accuracy=0.5, num_test_examples=10)
            if ins.action is Action.EVALUATE:
                payloads: list[Any] = [report]
            else:
                w = (base * np.float32(0.5) + np.float32(int(org[1:]) % 7)).astype(np.float32)
                payloads = [ModelWeights({"w": w}, 10), report]
            data = messages.encode_update(messages.Update(run_id, ins.round, org, payloads)).data
            reqs = [apb.PushUpdateRequest(run_id=run_id, round=ins.round, organization_id=org, chunk=c)
                    for c in chunks.split(data)]
            await retry(lambda reqs=reqs: stub.PushUpdate(iter(reqs), metadata=md, timeout=120))
            pushed += 1
            completed = ins.round
    raise TimeoutError(f"{org} timed out in run {run_id}")


async def retry(call: Any, attempts: int = 30) -> Any:
    """Retry transport failures and retryable rejections with a short backoff."""
    delay = 0.05
    for i in range(attempts):
        try:
            return await call()
        except grpc.aio.AioRpcError as err:
            retryable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
            if not retryable or i == attempts - 1:
                raise
        await asyncio.sleep(delay * (0.5 + np.random.random()))
        delay = min(delay * 2, 2.0)
    raise AssertionError("unreachable")


async def client_process(address: str, runs: list[tuple[str, int, int]], first: int, count: int,
                         timeout: float) -> None:
    """Clients c<first>..c<first+count-1>: every run in turn, all clients of this process concurrently."""
    for run_id, dim, clients in runs:
        mine = [i for i in range(first, first + count) if i < clients]
        if mine:
            await asyncio.gather(*(one_client(address, run_id, f"c{i}", dim, timeout) for i in mine))


# ================================================================================================ driver


@dataclass
class Samples:
    """What the sampler threads record."""

    health: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds) of each check
    health_failures: int = 0
    probe: list[tuple[float, float]] = field(default_factory=list)  # the same, on the health listener
    probe_failures: int = 0
    threads: list[tuple[float, int, int]] = field(default_factory=list)  # (time, threads, rss KiB)
    stop: threading.Event = field(default_factory=threading.Event)


def proc_status(pid: int) -> tuple[int, int]:
    """(threads, VmRSS KiB) of a process."""
    threads = rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
        elif line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return threads, rss


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of a process carry each name."""
    names: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread exited after the listing
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def sample(address: str, pid: int, s: Samples, probe: bool = False) -> None:
    """Health-check every 50 ms (the serving port, or with ``probe`` the health listener the kubelet's probes
    call); the serving port's sampler also reads the aggregator's thread count and RSS every 0.5 s."""
    checks, key = (s.probe, "probe_failures") if probe else (s.health, "health_failures")
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        next_proc = 0.0
        while not s.stop.is_set():
            t0 = time.perf_counter()
            try:
                stub.Check(health_pb2.HealthCheckRequest(service="hetfed.v1.Aggregator"), timeout=2)
                checks.append((time.monotonic(), time.perf_counter() - t0))
            except grpc.RpcError:
                setattr(s, key, getattr(s, key) + 1)
            now = time.monotonic()
            if not probe and now >= next_proc:
                s.threads.append((now, *proc_status(pid)))
                next_proc = now + 0.5
            s.stop.wait(max(0.0, 0.05 - (time.perf_counter() - t0)))


def run_phase(address: str, runs: list[tuple[str, int, int]], clients: int, processes: int,
              timeout: float, nice: int = 0) -> tuple[float, list[str]]:
    """Start the client processes for ``runs`` (``nice`` added to their niceness) and wait; (seconds, errors)."""
    per = -(-clients // processes)
    spec = json.dumps(runs)
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", address, spec, str(i * per), str(per),
                               str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=(lambda: os.nice(nice)) if nice else None)
             for i in range(processes) if i * per < clients]
    errors = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout + 60)
        if p.returncode:
            errors.append(out.decode(errors="replace")[-2000:])
    return time.monotonic() - t0, errors


def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = a + b x, with R²."""
    x, y = np.array(xs), np.array(ys)
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    ss_res, ss_tot = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {"intercept_s": float(a), "seconds_per_mb": float(b * 1e6), "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def main(argv: list[str] | None = None) -> int:
    """Run the load benchmark and print its figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--dims", default="256,4096,16384,32768", help="model sizes (float32 elements), one run each")
    p.add_argument("--few", type=int, default=10, help="clients of the first phase (thread count baseline)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--worker-threads", type=int, default=4)
    p.add_argument("--client-nice", type=int, default=0,
                   help="niceness added to the client processes: when they share the aggregator's cores (unlike a "
                   "deployment, where they run elsewhere), 10 keeps them from starving it")
    p.add_argument("--state-dir", type=Path, help="the aggregator's state directory (default: a temporary one)")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        address, spec, first, count, timeout = args.worker
        runs = [tuple(r) for r in json.loads(spec)]
        asyncio.run(client_process(address, runs, int(first), int(count), float(timeout)))  # type: ignore[arg-type]
        return 0
    dims = [int(d) for d in args.dims.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="hetfed-load-"))
    state = args.state_dir or workdir / "state"
    few_runs = [("few", dims[0], args.few)]
    many_runs = [(f"d{d}", d, args.clients) for d in dims]
    runs = [{"id": rid, "algorithm": "fedavg", "organizations": [f"c{i}" for i in range(n)], "rounds": ROUNDS,
             "round_deadline_seconds": 3600.0} for rid, _, n in few_runs + many_runs]
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    port, probe_port = ports
    cfg = {"server": {"listen": f"127.0.0.1:{port}", "metrics_port": -1, "state_dir": str(state),
                      "health_listen": f"127.0.0.1:{probe_port}", "worker_threads": args.worker_threads},
           "runs": runs}
    (workdir / "agg.json").write_text(json.dumps(cfg))
    ready = workdir / "ready"
    log = open(workdir / "aggregator.log", "wb")  # noqa: SIM115
    agg = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(workdir / "agg.json"),
                            "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    result: dict[str, Any] = {"load_average_start": os.getloadavg(), "cpus": os.cpu_count(), "clients": args.clients,
                              "processes": args.processes, "grpcio": grpc.__version__}
    samples = Samples()
    try:
        while not ready.exists():
            if agg.poll() is not None:
                raise RuntimeError((workdir / "aggregator.log").read_text()[-2000:])
            time.sleep(0.05)
        result["threads_idle"], result["rss_kib_idle"] = proc_status(agg.pid)
        result["thread_names_idle"] = thread_names(agg.pid)
        samplers = [threading.Thread(target=sample, args=(a, agg.pid, samples, probe), daemon=True)
                    for a, probe in ((address, False), (f"127.0.0.1:{probe_port}", True))]
        for sampler in samplers:
            sampler.start()
        t_few = time.monotonic()
        secs, errors = run_phase(address, few_runs, args.few, 1, args.timeout, args.client_nice)
        t_many = time.monotonic()
        result["few_seconds"] = round(secs, 1)
        secs, more = run_phase(address, many_runs, args.clients, args.processes, args.timeout, args.client_nice)
        t_end = time.monotonic()
        result["many_seconds"] = round(secs, 1)
        result["thread_names_after"] = thread_names(agg.pid)
        errors += more
        samples.stop.set()
        for sampler in samplers:
            sampler.join(10)
        statuses = {s.run_id: s for s in status_of(address, None, timeout=60)}
    finally:
        agg.terminate()
        try:
            agg.wait(30)
        except subprocess.TimeoutExpired:
            agg.kill()
        log.close()
    result["client_nice"] = args.client_nice
    result["errors"] = errors
    rows = []
    for rid, dim, _ in many_runs:
        s = statuses[rid]
        for h in s.history[1:ROUNDS]:  # train rounds 2..R: each starts when the previous closed
            moved = sum(t.bytes for t in h.traffic)
            rows.append({"run": rid, "dim": dim, "clients": h.clients, "round": h.round,
                         "seconds": round(h.duration_seconds, 3), "bytes": moved})
    result["rounds"] = rows
    result["fit"] = fit([r["bytes"] for r in rows], [r["seconds"] for r in rows]) if len(rows) > 2 else {}

    def latency(checks: list[tuple[float, float]], t0: float, t1: float, name: str) -> dict[str, Any]:
        lat = [x for t, x in checks if t0 <= t <= t1]
        return {f"{name}_checks": len(lat), f"{name}_max_ms": round(1000 * max(lat), 1) if lat else None,
                f"{name}_p99_ms": round(1000 * float(np.percentile(lat, 99)), 1) if lat else None,
                f"{name}_over_100ms": sum(x > 0.1 for x in lat)}

    def phase(t0: float, t1: float) -> dict[str, Any]:
        th = [(n, r) for t, n, r in samples.threads if t0 <= t <= t1]
        return {**latency(samples.probe, t0, t1, "probe"), **latency(samples.health, t0, t1, "health"),
                "threads_min": min(n for n, _ in th) if th else None, "threads_max": max(n for n, _ in th) if th else None,
                "rss_kib_max": max(r for _, r in th) if th else None}

    result["phase_few"] = {"clients": args.few, **phase(t_few, t_many)}
    result["phase_many"] = {"clients": args.clients, **phase(t_many, t_end)}
    result["health_failures"] = samples.health_failures
    result["probe_failures"] = samples.probe_failures
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
