"""Fault-injection harness for the aggregator: kills, full disks, damaged state files, fuzzed messages, a leak probe.

    python benchmarks/faults.py                       # every campaign, the figures of docs/reliability.md
    python benchmarks/faults.py --only kills,disk     # some campaigns: kills, disk, corrupt, fuzz, leak
    python benchmarks/faults.py --quick               # one of each (what the slow tests run)

A federation of lightweight numpy clients (threads of this process, the typed ``AggregatorClient`` over
loopback gRPC) runs a FedAvg run whose every update is a deterministic function of the organization, the
round and the global model it received. So any two runs in which every acknowledged update was used exactly
once end with bit-identical weights, and the harness compares every faulty run with an uninterrupted one.
A client that is sent the instructions of a round whose update it had pushed and seen acknowledged counts
an acknowledged update lost (the aggregator asks again for what it no longer holds).

- kills: the aggregator (a real ``hetfed aggregator`` process) is killed at every named point of its write
  path (``HETFED_CRASH_AT``, see ``hetfed.aggregator.journal.crashpoints``) and by SIGKILL at random moments, and
  restarted on the same port and state directory each time; every restart must succeed.
- disk: the disk fills during pushes, log fsyncs, history appends and checkpoints (the store's injectable
  file layer, ``FaultyDisk``, in an aggregator in this process), and, when this process may mount one, on a
  real tmpfs that a filler file fills at random moments; space returns after a while and the run must finish.
- corrupt: a state directory taken mid-run gets one file truncated, a byte flipped or the file deleted; the
  aggregator must either resume (and the run end with the reference weights) or refuse in one line naming
  the file; never crash, never silently start over.
- fuzz: N mutated messages to every RPC (and the health service) during a live run: no crash, no UNKNOWN
  status, bounded memory, the live run's final weights unchanged. Then, against a real mTLS aggregator,
  certificates naming more or less than one organization (two CNs in both orders, a CN and another
  organization URI, two URIs, none) and implausible values sent one at a time by a member (10^9 examples,
  weights of 1e30, accuracies of 1e300 and -3, a loss of -5, a negative count): each refused with its
  reason, and the round's model exactly as without them.
- leak: undecodable requests against the aggregator and against a bare grpcio server with a generated
  deserializer; resident memory per request.

Results print as a table and are written as JSON (``--json``). Only loopback is used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.journal.crashpoints import CRASH_POINTS, EXIT_CODE
from hetfed.aggregator.serving.server import RunningAggregator, start_aggregator
from hetfed.cli.certs import FederationCerts, make_federation_certs
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, codec
from hetfed.wire.config import to_mapping
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.identity import ORGANIZATION_URI_PREFIX
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind, Received
from hetfed.wire.phases import Action
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.specs import get_spec
from hetfed.wire.transport import TlsConfig, make_channel

# The failing disk lives with the tests (tests/faults.py), outside the product: the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults import DiskFault, FaultyDisk

T = TypeVar("T")
RUN = "r"
ORGS = ("a", "b", "c")
DIM = 2000
ROUNDS = 6
SPEC = get_spec("fedavg")
REPO = Path(__file__).resolve().parents[1]


# ================================================================================================ the federation


def examples(org: str) -> int:
    """Each organization's (declared and used) training examples."""
    return 10 * (1 + sum(map(ord, org)) % 7)


def update(org: str, round_: int, global_: np.ndarray | None) -> np.ndarray:
    """The organization's deterministic update for a round, from the global weights it received."""
    base = global_ if global_ is not None else np.random.default_rng(7).normal(size=DIM).astype(np.float32)
    noise = np.random.default_rng([sum(map(ord, org)), round_]).normal(size=DIM).astype(np.float32)
    return (base * np.float32(0.5) + noise).astype(np.float32)


def run_config(orgs: tuple[str, ...] = ORGS, rounds: int = ROUNDS, run_id: str = RUN) -> dict[str, Any]:
    """A FedAvg run whose rounds close only when every organization has pushed (no deadline closes)."""
    return {"id": run_id, "algorithm": "fedavg", "organizations": list(orgs), "rounds": rounds,
            "round_deadline_seconds": 3600.0}


@dataclass
class ClientLog:
    """What one organization saw."""

    acked: set[int] = field(default_factory=set)
    reasked: list[int] = field(default_factory=list)
    final: np.ndarray | None = None
    errors: list[str] = field(default_factory=list)
    retries: Counter[str] = field(default_factory=Counter)
    done: bool = False
    stop: bool = False  # set by the harness: give up now
    late: int = 0  # retried pushes that found their round closed


def stop_clients(logs: dict[str, ClientLog]) -> None:
    """Make every client give up at its next step."""
    for log in logs.values():
        log.stop = True


RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def retrying(call: Callable[[], T], log: ClientLog, deadline: float) -> T:
    """Retry transport failures and retryable rejections until ``deadline`` (as the client runtime does)."""
    delay = 0.02
    while True:
        try:
            return call()
        except RemoteError as err:
            if not (err.retryable or err.code in RETRY_CODES) or time.monotonic() > deadline or log.stop:
                raise
            log.retries[err.reason or err.code.name] += 1
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.5)


def run_client(address: str, org: str, log: ClientLog, deadline: float,
               before_push: Callable[[int], None] | None = None, run_id: str = RUN) -> None:
    """One organization's client until the run finishes (or ``deadline``); records into ``log``."""
    n = examples(org)
    declared = [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", np.zeros(DIM, np.float32))]
    try:
        with AggregatorClient(address, None, org, run_id, call_timeout=5) as client:
            retrying(lambda: client.join(declared, num_train_examples=n), log, deadline)
            completed = -1
            while time.monotonic() < deadline and not log.stop:
                ins = retrying(partial(client.pull, completed, 1.0, SPEC), log, deadline)
                if ins.action is Action.WAIT:
                    continue
                if ins.action is Action.FINISH:
                    log.done = True
                    return
                if ins.round in log.acked:
                    log.reasked.append(ins.round)
                mw = Received(ins.payloads).maybe(ModelWeights)
                global_ = None if mw is None else np.array(mw.tensors["w"])
                report = EvalMetrics(train_loss=0.5, num_train_examples=n, test_accuracy=0.5, num_test_examples=n)
                if ins.action is Action.EVALUATE:
                    log.final = global_
                    payloads: list[Any] = [report]
                else:
                    payloads = [ModelWeights({"w": update(org, ins.round, global_)}, n), report]
                if before_push is not None:
                    before_push(ins.round)
                try:
                    retrying(partial(client.push, ins.round, payloads), log, deadline)
                    log.acked.add(ins.round)
                except RemoteError as err:
                    # An unacknowledged push the round used before the aggregator died: its retry finds the
                    # round closed. The client runtime goes on the same way.
                    if err.reason != "late":
                        raise
                    log.late += 1
                completed = ins.round
            log.errors.append("stopped" if log.stop else "timed out")
    except RemoteError as err:
        log.errors.append(f"{err.code.name} {err.reason}: {err.details[:200]}")
    except Exception as exc:  # a harness bug must show, not hang
        log.errors.append(f"{type(exc).__name__}: {exc}")


@contextmanager
def federation(address: str, timeout: float = 120.0, orgs: tuple[str, ...] = ORGS,
               before_push: Callable[[int], None] | None = None) -> Iterator[dict[str, ClientLog]]:
    """Run one client thread per organization; the context's body runs while they federate."""
    logs = {o: ClientLog() for o in orgs}
    deadline = time.monotonic() + timeout
    threads = [threading.Thread(target=run_client, args=(address, o, logs[o], deadline, before_push), daemon=True)
               for o in orgs]
    for t in threads:
        t.start()
    try:
        yield logs
    except BaseException:
        stop_clients(logs)
        raise
    finally:
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic() + 5))


def finished(logs: dict[str, ClientLog]) -> bool:
    """Whether every client has seen the run finish (or given up)."""
    return all(log.done or log.errors for log in logs.values())


@dataclass
class Outcome:
    """The figures of one faulty run against the reference."""

    kills: int = 0
    restarts: int = 0
    restart_failures: list[str] = field(default_factory=list)
    acked: int = 0
    lost: int = 0
    identical: bool = False
    finished: bool = False
    errors: list[str] = field(default_factory=list)
    retries: Counter[str] = field(default_factory=Counter)
    storage_failures: int = 0
    late: int = 0

    def add_logs(self, logs: dict[str, ClientLog], reference: np.ndarray | None) -> None:
        """Fold the clients' logs in."""
        self.acked += sum(len(log.acked) for log in logs.values())
        self.lost += sum(len(log.reasked) for log in logs.values())
        self.finished = all(log.done for log in logs.values())
        self.errors += [f"{o}: {e}" for o, log in logs.items() for e in log.errors]
        self.late += sum(log.late for log in logs.values())
        for log in logs.values():
            self.retries.update(log.retries)
        finals = [log.final for log in logs.values()]
        self.identical = reference is not None and all(
            f is not None and np.array_equal(f, reference) for f in finals)


# ================================================================================================ processes


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AggregatorProcess:
    """A real ``hetfed aggregator`` process on a fixed port and state directory, started and killed at will."""

    def __init__(self, workdir: Path, runs: list[dict[str, Any]], state_dir: Path | None = None,
                 worker_threads: int = 2, tls: TlsConfig | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.state_dir = state_dir or workdir / "state"
        server: dict[str, Any] = {"listen": f"127.0.0.1:{self.port}", "metrics_port": -1,
                                  "state_dir": str(self.state_dir), "worker_threads": worker_threads}
        if tls is not None:
            server["tls"] = to_mapping(tls)
        cfg = {"server": server, "runs": runs}
        self.config = workdir / "aggregator.json"
        self.config.write_text(json.dumps(cfg))
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        """host:port of the aggregator."""
        return f"127.0.0.1:{self.port}"

    def log_path(self) -> Path:
        """The log of the current (last) process."""
        return self.workdir / f"aggregator-{self.starts}.log"

    def start(self, crash_at: str = "", timeout: float = 60.0, delay_at: str = "") -> str:
        """Start; returns "" when it is serving, else why not (its exit code and the end of its log).

        ``crash_at`` and ``delay_at`` arm ``HETFED_CRASH_AT`` and ``HETFED_DELAY_AT`` (crashpoints.py)."""
        self.starts += 1
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("HETFED_CRASH_AT", None)
        env.pop("HETFED_DELAY_AT", None)
        if crash_at:
            env["HETFED_CRASH_AT"] = crash_at
        if delay_at:
            env["HETFED_DELAY_AT"] = delay_at
        with open(self.log_path(), "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(self.config), "--ready-file",
                 str(ready)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            code = self.proc.poll()
            if code is not None:
                return f"exit {code}: {self.log_tail()}"
            if time.monotonic() > deadline:
                return "did not start in time"
            time.sleep(0.02)
        return ""

    def log_tail(self, lines: int = 6) -> str:
        """The end of the current process's log."""
        text = self.log_path().read_text(errors="replace") if self.log_path().exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def exited(self) -> int | None:
        """The exit code once the process has ended."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def rss_kib(self) -> int:
        """The process's resident set size."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def threads(self) -> int:
        """The process's thread count."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


# ================================================================================================ kills


def reference_weights(workdir: Path, rounds: int = ROUNDS) -> np.ndarray:
    """The final weights of an uninterrupted run of ``rounds`` rounds."""
    workdir.mkdir(parents=True, exist_ok=True)
    agg = AggregatorProcess(workdir, [run_config(rounds=rounds)])
    why = agg.start()
    if why:
        raise RuntimeError(f"the reference aggregator did not start: {why}")
    try:
        with federation(agg.address) as logs:
            pass
    finally:
        agg.stop()
    out = Outcome()
    out.add_logs(logs, None)
    final = logs[ORGS[0]].final
    if not out.finished or out.errors or final is None:
        raise RuntimeError(f"the reference run failed: {out.errors}")
    return final


def paced(seconds: float) -> Callable[[int], None] | None:
    """A ``before_push`` hook that makes every push wait ``seconds`` (local work), so a run lasts long enough for
    faults at random moments to land inside it; None for no pacing."""
    return (lambda _round: time.sleep(seconds)) if seconds > 0 else None


def killed_run(workdir: Path, reference: np.ndarray, *, point: str = "", visits: int = 2, random_kills: int = 0,
               max_kills: int = 2, rng: random.Random, pace: float = 0.0) -> Outcome:
    """One run whose aggregator is killed ``max_kills`` times, at ``point`` (every ``visits``-th visit of
    it in each process) or at random moments, and restarted each time; ``pace`` seconds of work per push."""
    workdir.mkdir(parents=True, exist_ok=True)
    agg = AggregatorProcess(workdir, [run_config()])
    out = Outcome()
    crash = f"{point}:{visits}" if point else ""

    def start() -> bool:
        for _ in range(3):
            why = agg.start(crash if out.kills < max_kills else "")
            if not why:
                return True
            if why.startswith(f"exit {EXIT_CODE}"):  # killed at its crash point while starting
                out.kills += 1
                continue
            out.restart_failures.append(why)
            return False
        return False

    if not start():
        return out

    def schedule() -> float | None:
        return time.monotonic() + rng.uniform(0.02, 0.5) if random_kills and out.kills < max_kills else None

    next_kill = schedule()
    with federation(agg.address, before_push=paced(pace)) as logs:
        while not finished(logs):
            code = agg.exited()
            if code is not None:
                if code == EXIT_CODE:  # it reached its crash point
                    out.kills += 1
                elif code != -signal.SIGKILL:  # not our SIGKILL either: a crash
                    out.restart_failures.append(f"the aggregator exited with {code}: {agg.log_tail()}")
                    stop_clients(logs)
                    break
                out.restarts += 1
                if not start():
                    stop_clients(logs)
                    break
                next_kill = schedule()
            elif next_kill is not None and time.monotonic() >= next_kill:
                agg.kill()
                out.kills += 1
                next_kill = None
            time.sleep(0.01)
    agg.stop()
    out.add_logs(logs, reference)
    return out


def campaign_kills(workdir: Path, reference: np.ndarray, quick: bool, rng: random.Random) -> dict[str, Any]:
    """Every named crash point (twice per run) and random SIGKILLs."""
    rows: dict[str, Outcome] = {}
    # The spool's points are reached only by a cut push, the stage log's only by a secure round: this federation
    # makes neither.
    points = CRASH_POINTS[:3] if quick else tuple(p for p in CRASH_POINTS if not p.startswith(("spool.", "stages.")))
    for point in points:
        # The n-th visit: pushes visit the log points 3x a round; closes and joins visit the others.
        visits = 4 if point.startswith(("wal.", "push.")) else 2
        rows[point] = killed_run(workdir / point, reference, point=point, visits=visits, rng=rng)
        print(f"  {point}: {summary(rows[point])}", flush=True)
    for i in range(1 if quick else 4):
        rows[f"random-{i}"] = killed_run(workdir / f"random-{i}", reference, random_kills=3, max_kills=3, rng=rng,
                                          pace=0.1)
        print(f"  random-{i}: {summary(rows[f'random-{i}'])}", flush=True)
    return {name: vars_of(o) for name, o in rows.items()}


def summary(o: Outcome) -> str:
    """One line of an outcome."""
    return (f"kills {o.kills}, restarts {o.restarts}, restart failures {len(o.restart_failures)}, acknowledged "
            f"{o.acked}, lost {o.lost}, finished {o.finished}, identical {o.identical}"
            + (f", storage failures {o.storage_failures}" if o.storage_failures else "")
            + (f", errors {o.errors[:3]}" if o.errors else "")
            + (f", restart failures {o.restart_failures[:2]}" if o.restart_failures else ""))


def vars_of(o: Outcome) -> dict[str, Any]:
    """An outcome as JSON."""
    d = dict(vars(o))
    d["retries"] = dict(o.retries)
    return d


# ================================================================================================ disk


def in_process(state_dir: Path, disk: FaultyDisk, runs: list[dict[str, Any]] | None = None) -> RunningAggregator:
    """An aggregator in this process whose store uses ``disk``."""
    cfg = aggregator_config_from_mapping({
        "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(state_dir)},
        "runs": runs or [run_config()]})
    return start_aggregator(cfg, disk)


DISK_FAULTS: dict[str, DiskFault] = {
    "push: log append ENOSPC": DiskFault("pwrite", "updates.wal", partial=0.5, times=-1),
    "push: log fsync EIO": DiskFault("fsync", "updates.wal", times=-1),
    "close: history append ENOSPC": DiskFault("pwrite", "history.jsonl", partial=0.5, times=-1),
    "close: history fsync EIO": DiskFault("fsync", "history.jsonl", times=-1),
    "close: checkpoint write ENOSPC": DiskFault("pwrite", "checkpoint.npz", partial=0.5, times=-1),
    "close: checkpoint rename EIO": DiskFault("replace", "checkpoint.npz", times=-1),
}


def disk_full_run(workdir: Path, reference: np.ndarray, fault: DiskFault, skip: int, hold: float) -> Outcome:
    """A run whose disk fails ``fault``-wise after ``skip`` matching operations, until ``hold`` seconds later."""
    disk = FaultyDisk()
    agg = in_process(workdir / "state", disk)
    out = Outcome()
    armed = DiskFault(fault.op, fault.file, fault.error, -1, skip, fault.partial)
    disk.add(armed)
    with federation(f"127.0.0.1:{agg.port}") as logs:
        while disk.failed == 0 and not finished(logs):
            time.sleep(0.005)
        time.sleep(hold)
        disk.clear()  # space returns
        while not finished(logs):
            time.sleep(0.01)
    agg.stop()
    out.storage_failures = disk.failed
    out.add_logs(logs, reference)
    return out


@contextmanager
def tmpfs(size: str) -> Iterator[Path | None]:
    """A tmpfs of ``size`` mounted on a temporary directory (None when this process may not mount)."""
    where = Path(tempfile.mkdtemp(prefix="hetfed-tmpfs-"))
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    try:
        yield where if ok.returncode == 0 else None
    finally:
        if ok.returncode == 0:
            subprocess.run(["umount", str(where)], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


def tmpfs_run(workdir: Path, reference: np.ndarray, rng: random.Random, fills: int) -> Outcome | None:
    """A real aggregator on a tiny tmpfs that a filler file fills completely ``fills`` times, for a while."""
    with tmpfs("2m") as mount:
        if mount is None:
            return None
        workdir.mkdir(parents=True, exist_ok=True)
        agg = AggregatorProcess(workdir, [run_config(rounds=12)], state_dir=mount / "state")
        why = agg.start()
        out = Outcome()
        if why:
            out.restart_failures.append(why)
            return out
        filler = mount / "filler"
        done_fills = 0
        with federation(agg.address, timeout=300, before_push=paced(0.1)) as logs:
            while not finished(logs):
                if done_fills < fills and rng.random() < 0.05:
                    with suppress(OSError), open(filler, "wb", buffering=0) as f:
                        while True:  # unbuffered: the write that finds the disk full raises, nothing is pending
                            f.write(b"\0" * 4096)
                    time.sleep(rng.uniform(0.3, 1.0))
                    filler.unlink()
                    done_fills += 1
                time.sleep(0.01)
        agg.stop()
        text = "".join(p.read_text(errors="replace") for p in workdir.glob("aggregator-*.log"))
        out.storage_failures = len(re.findall(r"rejected \(storage_unavailable\)|could not close", text))
        out.add_logs(logs, reference_weights(workdir / "reference", rounds=12))
        out.errors.append(f"fills: {done_fills}; failures by kind: "
                          f"push {len(re.findall('could not log the update', text))}, "
                          f"history {len(re.findall('could not append round', text))}, "
                          f"checkpoint {len(re.findall('could not write .*checkpoint', text))}")
        return out


def campaign_disk(workdir: Path, reference: np.ndarray, quick: bool, rng: random.Random) -> dict[str, Any]:
    """Disk faults at every kind of write, through the file layer; and a real tmpfs filled at random."""
    rows: dict[str, Any] = {}
    for name, fault in list(DISK_FAULTS.items())[: 2 if quick else None]:
        for trial in range(1 if quick else 2):
            skip = rng.randrange(2, 12) if fault.file == "updates.wal" else rng.randrange(1, 5)
            o = disk_full_run(workdir / f"{re.sub(r'[^a-z]+', '-', name)}-{trial}", reference, fault, skip,
                              rng.uniform(0.3, 1.0))
            rows[f"{name} #{trial}"] = vars_of(o)
            print(f"  {name} #{trial}: {summary(o)}", flush=True)
    if not quick:
        o2 = tmpfs_run(workdir / "tmpfs", reference, rng, fills=5)
        rows["tmpfs (real ENOSPC)"] = vars_of(o2) if o2 is not None else "skipped: cannot mount a tmpfs here"
        print(f"  tmpfs: {summary(o2) if o2 is not None else 'skipped (cannot mount)'}", flush=True)
    return rows


# ================================================================================================ corruption


def damaged(path: Path, how: str, rng: random.Random) -> str:
    """Damage one file; returns what was done."""
    if how == "delete":
        path.unlink()
        return "deleted"
    blob = bytearray(path.read_bytes())
    if not blob:
        return "empty already"
    at = rng.randrange(len(blob))
    if how == "truncate":
        path.write_bytes(bytes(blob[:at]))
        return f"truncated at {at} of {len(blob)}"
    blob[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(blob))
    return f"bit flipped at {at} of {len(blob)}"


def campaign_corrupt(workdir: Path, reference: np.ndarray, quick: bool, rng: random.Random) -> dict[str, Any]:
    """Damage each state file of a mid-run snapshot; the aggregator resumes correctly or refuses clearly."""
    snap = workdir / "snapshot"
    snap.mkdir(parents=True, exist_ok=True)
    agg = AggregatorProcess(snap, [run_config()])
    # Stop mid-round 3 with two updates logged: 3 joins, 2 rounds of 3 pushes, then 2 more.
    agg.start(crash_at="wal.synced:8")
    with federation(agg.address, timeout=60) as logs:
        while agg.exited() is None:
            time.sleep(0.01)
        stop_clients(logs)
    agg.kill()
    state = snap / "state"
    rows: dict[str, Counter[str]] = {}
    details: list[str] = []
    trials = 1 if quick else 6
    for name in ("checkpoint.npz", "history.jsonl", "updates.wal"):
        for how in ("truncate", "flip", "delete"):
            key = f"{name} {how}"
            rows[key] = Counter()
            for t in range(trials if how != "delete" else 1):
                work = workdir / f"{name}-{how}-{t}"
                shutil.copytree(state, work / "state")
                what = damaged(work / "state" / RUN / name, how, rng)
                trial = AggregatorProcess(work, [run_config()])
                why = trial.start()
                if why:
                    last = why.rsplit(" | ", 1)[-1]
                    clear = why.startswith("exit 2:") and "Traceback" not in why and name in last and \
                        last.startswith(("exit 2: hetfed aggregator: run", "hetfed aggregator: run"))
                    verdict = "refused (one line naming the file)" if clear else "crashed"
                    details.append(f"{key}: {what}: {last[:300]}")
                else:
                    with federation(trial.address, timeout=60) as tlogs:
                        pass
                    trial.stop()
                    o = Outcome()
                    o.add_logs(tlogs, reference)
                    verdict = "resumed, reference weights" if o.finished and o.identical else "resumed, WRONG weights"
                    if not (o.finished and o.identical):
                        details.append(f"{key}: {what}: {summary(o)}")
                rows[key][verdict] += 1
            print(f"  {key}: {dict(rows[key])}", flush=True)
    return {"outcomes": {k: dict(v) for k, v in rows.items()}, "details": details}


# ================================================================================================ fuzz


class Fuzzer:
    """Mutated and random requests for every RPC, built from valid ones."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def mutate(self, data: bytes) -> bytes:
        """Flip bits, cut, insert, overwrite or replace ``data``."""
        r = self.rng
        b = bytearray(data)
        how = r.randrange(6)
        if how == 0 and b:
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        elif how == 1 and b:
            b = b[: r.randrange(len(b))]
        elif how == 2:
            at = r.randrange(len(b) + 1)
            b[at:at] = r.randbytes(r.randint(1, 64))
        elif how == 3 and b:
            at = r.randrange(len(b))
            b[at : at + 8] = r.randbytes(8)
        elif how == 4:
            b = bytearray(r.randbytes(r.randint(0, 256)))
        else:
            b = b + b[: r.randrange(len(b) + 1)]
        return bytes(b)

    def ident(self) -> str:
        """An identity: the fuzz run's members, an outsider, none, or junk."""
        return self.rng.choice(["f1", "f2", "f1", "mallory", "", "x" * self.rng.randint(60, 300)])

    def run_id(self) -> str:
        """Mostly the fuzz run; sometimes the live run (never as its members), unknown or junk ones."""
        return self.rng.choice(["fuzz", "fuzz", "fuzz", "nope", "", "r", "y" * self.rng.randint(60, 300)])

    def number(self) -> float:
        """Awkward numbers."""
        return self.rng.choice([float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e300, 2.0**63,
                                self.rng.uniform(-5, 5)])

    def join(self) -> bytes:
        """A JoinRequest, often malformed."""
        r = self.rng
        req = apb.JoinRequest(run_id=self.run_id(), organization_id=self.ident(),
                              num_train_examples=r.choice([0, 10, -1, 2**63 - 1, r.randrange(10**6)]))
        for _ in range(r.choice([0, 1, 1, 2, 50])):
            req.declared_tensors.add(payload_kind=r.randrange(-1, 12), name=r.choice(["w", "", "w" * 300, "b"]),
                                     dtype=r.randrange(-1, 10), shape=[r.choice([DIM, -1, 0, 2**40, 3])])
        data = req.SerializeToString()
        return self.mutate(data) if r.random() < 0.5 else data

    def pull(self) -> bytes:
        """A PullInstructionsRequest with awkward waits and rounds."""
        r = self.rng
        wait = self.number() if r.random() < 0.5 else r.uniform(0, 0.05)
        req = apb.PullInstructionsRequest(run_id=self.run_id(), organization_id=self.ident(),
                                          completed_round=r.choice([-1, 0, 1, 5, -(2**63), 2**63 - 1]),
                                          wait_seconds=min(wait, 0.05) if wait == wait and wait > 0 else wait)
        data = req.SerializeToString()
        return self.mutate(data) if r.random() < 0.3 else data

    def update_bytes(self) -> bytes:
        """A serialized Update, valid-looking or broken in its payloads."""
        r = self.rng
        shape = r.choice([(DIM,), (DIM,), (3,), (0,), (DIM + 1,)])
        w = np.random.default_rng(r.randrange(2**32)).normal(size=shape).astype(
            r.choice([np.float32, np.float32, np.float64, np.int64]))
        if r.random() < 0.2 and w.size and w.dtype.kind == "f":
            w.flat[0] = r.choice([np.nan, np.inf, 1e30])
        extra = {f"m{i}": r.random() for i in range(r.choice([0, 1, 3, 100]))}
        payloads: list[Any] = [
            ModelWeights({r.choice(["w", "v", ""]): w}, r.choice([1, 10, 0, -3, 2**62, 10**9])),
            EvalMetrics(test_accuracy=self.number() if r.random() < 0.2 else r.choice([0.5, 0.5, -3.0, 1.5]),
                        train_loss=r.choice([0.5, 0.5, -5.0, self.number()]),
                        num_test_examples=r.choice([1, -1, 2**62]), extra=extra),
        ]
        r.shuffle(payloads)
        payloads = payloads[: r.choice([0, 1, 2, 2, 2])]
        env = apb.Envelope(run_id=self.run_id(), round=r.choice([0, 1, 2, -1, 10**9]), organization_id=self.ident(),
                           payload_kinds=[r.choice([1, 8, 3, 99]) for _ in payloads])  # type: ignore[misc]
        msg = apb.Update(envelope=env)
        for p in payloads:
            with suppress(Exception):
                codec.fill_payload(msg.payloads.add(), p)
        data = msg.SerializeToString()
        return self.mutate(data) if r.random() < 0.4 else data

    def push(self) -> list[bytes]:
        """A PushUpdate stream: chunk requests, their headers sometimes tampered with."""
        r = self.rng
        data = self.update_bytes()
        parts = list(chunks.split(data, r.choice([1024, 4096, 1 << 20])))
        if r.random() < 0.3 and parts:
            c = r.choice(parts)
            setattr(c, r.choice(["index", "count", "total_bytes"]), r.choice([0, 1, 2**31, 5]))
        if r.random() < 0.2 and parts:  # a wrong digest, or an older sender's SHA-256 in place of BLAKE3
            if r.random() < 0.5:
                parts[-1].blake3 = r.randbytes(32)
            else:
                parts[-1].sha256, parts[-1].blake3 = r.randbytes(32), b""
        if r.random() < 0.1:
            r.shuffle(parts)
        run_id, org, round_ = self.run_id(), self.ident(), r.choice([0, 1, 2, 3, -1, 10**9])
        reqs = [apb.PushUpdateRequest(run_id=run_id, round=round_, organization_id=org, chunk=c).SerializeToString()
                for c in parts]
        if r.random() < 0.2 and reqs:
            i = r.randrange(len(reqs))
            reqs[i] = self.mutate(reqs[i])
        return reqs

    def status(self) -> bytes:
        """A StatusRequest."""
        data = apb.StatusRequest(run_id=self.run_id()).SerializeToString()
        return self.mutate(data) if self.rng.random() < 0.5 else data


def fuzz_messages(address: str, n: int, rng: random.Random, progress: Callable[[int], None],
                  on_every: Callable[[int], None]) -> Counter[str]:
    """Send ``n`` fuzzed messages; the status codes they got."""
    fz = Fuzzer(rng)
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(address) as ch:
        base = "/hetfed.v1.Aggregator/"
        for i in range(n):
            kind = rng.choice(["join", "pull", "push", "push", "status", "garbage", "health"])
            md = (("x-hetfed-organization", fz.ident()),) if rng.random() < 0.8 else ()
            try:
                if kind == "join":
                    ch.unary_unary(base + "Join")(fz.join(), metadata=md, timeout=5)
                elif kind == "pull":
                    list(ch.unary_stream(base + "PullInstructions")(fz.pull(), metadata=md, timeout=5))
                elif kind == "push":
                    ch.stream_unary(base + "PushUpdate")(iter(fz.push()), metadata=md, timeout=5)
                elif kind == "status":
                    ch.unary_unary(base + "Status")(fz.status(), metadata=md, timeout=5)
                elif kind == "health":
                    ch.unary_unary("/grpc.health.v1.Health/Check")(fz.mutate(b"\n\x00"), timeout=5)
                else:
                    method = rng.choice(["Join", "PullInstructions", "Status"])
                    call = ch.unary_stream(base + method) if method == "PullInstructions" else \
                        ch.unary_unary(base + method)
                    out = call(rng.randbytes(rng.randint(0, 512)), metadata=md, timeout=5)
                    if method == "PullInstructions":
                        list(out)
                codes["OK"] += 1
            except grpc.RpcError as err:
                codes[err.code().name] += 1
            progress(i + 1)
            if (i + 1) % 500 == 0:
                on_every(i + 1)
    return codes


def campaign_fuzz(workdir: Path, reference: np.ndarray, quick: bool, rng: random.Random, n: int) -> dict[str, Any]:
    """``n`` fuzzed messages during a live run, which must end with the reference weights."""
    workdir.mkdir(parents=True, exist_ok=True)
    fuzz_run = {"id": "fuzz", "algorithm": "fedavg", "organizations": ["f1", "f2"], "rounds": 100_000,
                "min_clients": 1, "round_deadline_seconds": 0.05}
    agg = AggregatorProcess(workdir, [run_config(), fuzz_run])
    why = agg.start()
    if why:
        return {"error": why}
    sent = [0]
    rounds = ROUNDS + 1

    stopped = [False]

    def pace(round_: int) -> None:  # spread the live run's rounds over the fuzzing
        while sent[0] < n * (round_ - 1) / rounds and agg.exited() is None and not stopped[0]:
            time.sleep(0.01)

    samples: list[tuple[int, int, float]] = []

    def sample(i: int) -> None:
        t0 = time.perf_counter()
        with grpc.insecure_channel(agg.address) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        samples.append((i, agg.rss_kib(), time.perf_counter() - t0))

    sample(0)
    t0 = time.monotonic()
    with federation(agg.address, timeout=3600, before_push=pace) as logs:
        try:
            codes = fuzz_messages(agg.address, n, rng, lambda i: sent.__setitem__(0, i), sample)
        except BaseException:
            stopped[0] = True
            raise
    elapsed = time.monotonic() - t0
    alive = agg.exited() is None
    agg.stop()
    out = Outcome()
    out.add_logs(logs, reference)
    rss = [s[1] for s in samples]
    after_warmup = rss[len(rss) // 5 :] or rss
    return {"messages": n, "seconds": round(elapsed, 1), "codes": dict(codes), "unknown": codes.get("UNKNOWN", 0),
            "aggregator_alive": alive, "live_run": vars_of(out),
            "rss_kib": {"start": rss[0], "end": rss[-1], "max": max(rss),
                        "growth_after_first_fifth": after_warmup[-1] - after_warmup[0]},
            "health_check_max_seconds": round(max(s[2] for s in samples), 4)}


# ================================================================================================ trust


def crafted_cert(certs: FederationCerts, out: Path, name: str, cns: list[str], uris: list[str]) -> TlsConfig:
    """A clientAuth certificate signed by the federation's CA with the given CNs (in order) and organization URIs."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in cns]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / f"{name}-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return TlsConfig(cert=str(out / f"{name}.pem"), key=str(out / f"{name}-key.pem"), ca=str(certs.ca))


TRUST_ORGS = ("t1", "t2")
# name: (CNs, organization URIs, expected reason)
BAD_CERTS = {
    "two CNs": (["t1", "tx"], [], "ambiguous_identity"),
    "two CNs, other order": (["tx", "t1"], [], "ambiguous_identity"),
    "CN and another URI": (["t1"], [ORGANIZATION_URI_PREFIX + "t2"], "conflicting_identity"),
    "two URIs": (["t1"], [ORGANIZATION_URI_PREFIX + "t1", ORGANIZATION_URI_PREFIX + "t2"], "ambiguous_identity"),
    "no identity": ([], [], "no_identity"),
}
W_TRUST = np.array([1.0, 2.0, 3.0], np.float32)


def _implausible() -> dict[str, tuple[list[Any], str]]:
    good = EvalMetrics(train_loss=0.5, test_accuracy=0.5, num_test_examples=5)
    return {
        "num_examples 1e9, none declared": ([ModelWeights({"w": W_TRUST}, 10**9), good], "invalid_value"),
        "weights of 1e30": ([ModelWeights({"w": np.array([1e30, -1e30, 1], np.float32)}, 10), good],
                            "implausible_update"),
        "test_accuracy 1e300": ([ModelWeights({"w": W_TRUST}, 10), EvalMetrics(test_accuracy=1e300)],
                                "implausible_metric"),
        "test_accuracy -3": ([ModelWeights({"w": W_TRUST}, 10), EvalMetrics(test_accuracy=-3.0)],
                             "implausible_metric"),
        "train_loss -5": ([ModelWeights({"w": W_TRUST}, 10), EvalMetrics(train_loss=-5.0)], "implausible_metric"),
        "negative test count": ([ModelWeights({"w": W_TRUST}, 10), EvalMetrics(num_test_examples=-1)],
                                "invalid_value"),
    }


def campaign_trust(workdir: Path) -> dict[str, Any]:
    """A real mTLS aggregator: certificates naming more or less than one organization, and implausible values
    sent one at a time by a member; each must be refused with its reason, and the round must end as without them."""
    workdir.mkdir(parents=True, exist_ok=True)
    certs = make_federation_certs(workdir / "certs", list(TRUST_ORGS))
    run = {"id": "t", "algorithm": "fedavg", "organizations": list(TRUST_ORGS), "rounds": 1}
    agg = AggregatorProcess(workdir, [run], tls=certs.aggregator_tls())
    why = agg.start()
    if why:
        return {"error": why}
    results: dict[str, Any] = {"certificates": {}, "values": {}}
    try:
        for name, (cns, uris, reason) in BAD_CERTS.items():
            tls = crafted_cert(certs, workdir / "certs", name.replace(" ", "_").replace(",", ""), cns, uris)
            with make_channel(agg.address, tls) as ch:
                try:
                    ch.unary_unary("/hetfed.v1.Aggregator/Join")(
                        apb.JoinRequest(run_id="t", organization_id="t1").SerializeToString(), timeout=10)
                    got = "OK"
                except grpc.RpcError as err:
                    got = f"{err.code().name} {RemoteError.of(err).reason}"
            results["certificates"][name] = {"expected": f"UNAUTHENTICATED {reason}", "got": got}
        declared = [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", W_TRUST)]
        with AggregatorClient(agg.address, certs.client_tls("t1"), "t1", "t", call_timeout=10) as t1, \
                AggregatorClient(agg.address, certs.client_tls("t2"), "t2", "t", call_timeout=10) as t2:
            t1.join(declared)
            t2.join(declared, num_train_examples=30)
            t1.pull(-1, 1.0, SPEC)
            for name, (payloads, reason) in _implausible().items():
                try:
                    t1.push(1, payloads)
                    got = "OK"
                except RemoteError as err:
                    got = f"{err.code.name} {err.reason}"
                results["values"][name] = {"expected": f"INVALID_ARGUMENT {reason}", "got": got}
            report = EvalMetrics(train_loss=0.5, test_accuracy=0.5, num_test_examples=5)
            t1.push(1, [ModelWeights({"w": W_TRUST}, 10), report])
            t2.push(1, [ModelWeights({"w": W_TRUST * 3}, 30), report])
            ins = t1.pull(1, 5.0, SPEC)
            mw = Received(ins.payloads).maybe(ModelWeights)
            got_w = None if mw is None else np.asarray(mw.tensors["w"])
            # (10·W + 30·3W) / 40 = 2.5·W: the round as if the implausible updates had never been sent.
            results["global_model_identical"] = got_w is not None and bool(np.array_equal(got_w, W_TRUST * 2.5))
    finally:
        agg.stop()
    results["all_refused"] = all(v["got"] == v["expected"] for part in ("certificates", "values")
                                 for v in results[part].values())
    return results


# ================================================================================================ leak


def _bare_server(ready: str) -> None:
    """A bare grpcio (sync) server with a generated deserializer, for the leak probe (a subprocess)."""
    from concurrent import futures

    def join(request: apb.JoinRequest, context: grpc.ServicerContext) -> apb.JoinResponse:
        return apb.JoinResponse()

    handler = grpc.method_handlers_generic_handler("hetfed.v1.Aggregator", {"Join": grpc.unary_unary_rpc_method_handler(
        join, request_deserializer=apb.JoinRequest.FromString, response_serializer=apb.JoinResponse.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(ready).write_text(str(port))
    server.wait_for_termination()


def rss_of(pid: int) -> int:
    """VmRSS of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def probe(address: str, pid: int, n: int) -> dict[str, Any]:
    """RSS growth of ``pid`` over ``n`` undecodable Join requests (after 2,000 of warm-up)."""
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary("/hetfed.v1.Aggregator/Join")

        def burst(k: int) -> None:
            for _ in range(k):
                try:
                    call(b"\xff\xff\xff\xff not a protobuf", metadata=(("x-hetfed-organization", "a"),), timeout=5)
                except grpc.RpcError as err:
                    codes[err.code().name] += 1

        burst(2000)
        before = rss_of(pid)
        burst(n)
        after = rss_of(pid)
    return {"requests": n, "rss_kib_before": before, "rss_kib_after": after,
            "bytes_per_request": round((after - before) * 1024 / n, 1), "codes": dict(codes)}


def campaign_leak(workdir: Path, quick: bool) -> dict[str, Any]:
    """Undecodable requests: the aggregator against a bare grpcio server with a generated deserializer."""
    n = 2000 if quick else 20_000
    workdir.mkdir(parents=True, exist_ok=True)
    agg = AggregatorProcess(workdir, [{"id": RUN, "algorithm": "local", "organizations": ["a"]}])
    why = agg.start()
    if why:
        return {"error": why}
    assert agg.proc is not None
    ours = probe(agg.address, agg.proc.pid, n)
    agg.stop()
    ready = workdir / "bare.port"
    bare = subprocess.Popen([sys.executable, __file__, "--bare-server", str(ready)])
    try:
        while not ready.exists():
            time.sleep(0.02)
        theirs = probe(f"127.0.0.1:{ready.read_text()}", bare.pid, n)
    finally:
        bare.kill()
        bare.wait()
    return {"aggregator": ours, "bare_grpcio_sync_server": theirs, "grpcio": grpc.__version__}


# ================================================================================================ main


def main(argv: list[str] | None = None) -> int:
    """Run the campaigns and print their figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="kills,disk,corrupt,fuzz,leak")
    p.add_argument("--quick", action="store_true", help="one of each scenario (the slow tests' size)")
    p.add_argument("--fuzz-messages", type=int, default=10_500)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--bare-server", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bare_server:
        _bare_server(args.bare_server)
        return 0
    only = set(args.only.split(","))
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hetfed-faults-"))
    import logging

    logging.basicConfig(level=logging.CRITICAL)  # the in-process aggregators' rejections are expected
    results: dict[str, Any] = {"load_average_start": os.getloadavg(), "seed": args.seed, "quick": args.quick}
    t0 = time.monotonic()
    reference = reference_weights(workdir) if only & {"kills", "disk", "corrupt", "fuzz"} else np.zeros(0)
    if "kills" in only:
        print("kills:", flush=True)
        results["kills"] = campaign_kills(workdir / "kills", reference, args.quick, rng)
    if "disk" in only:
        print("disk:", flush=True)
        results["disk"] = campaign_disk(workdir / "disk", reference, args.quick, rng)
    if "corrupt" in only:
        print("corrupt:", flush=True)
        results["corrupt"] = campaign_corrupt(workdir / "corrupt", reference, args.quick, rng)
    if "fuzz" in only:
        print("fuzz:", flush=True)
        n = 500 if args.quick else args.fuzz_messages
        results["fuzz"] = campaign_fuzz(workdir / "fuzz", reference, args.quick, rng, n)
        results["fuzz"]["trust"] = campaign_trust(workdir / "trust")
        print(f"  {json.dumps(results['fuzz'], default=str)}", flush=True)
    if "leak" in only:
        print("leak:", flush=True)
        results["leak"] = campaign_leak(workdir / "leak", args.quick)
        print(f"  {json.dumps(results['leak'])}", flush=True)
    results["seconds"] = round(time.monotonic() - t0, 1)
    results["load_average_end"] = os.getloadavg()
    print(report(results))
    if args.json:  # the messages quote files under the work directory: the record names it <workdir>
        text = json.dumps(results, indent=2, default=str).replace(str(workdir), "<workdir>")
        args.json.write_text(text + "\n")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if verdict(results) else 1


def verdict(results: dict[str, Any]) -> bool:
    """Whether every figure meets its bar."""
    ok = True
    for row in results.get("kills", {}).values():
        ok &= not row["restart_failures"] and row["lost"] == 0 and row["identical"] and row["finished"]
        ok &= row["kills"] >= 1  # a run whose fault never landed proves nothing
    for name, row in results.get("disk", {}).items():
        if isinstance(row, dict):
            ok &= not row["restart_failures"] and row["lost"] == 0 and row["finished"] and row["identical"]
            fills = [int(m.group(1)) for e in row.get("errors", []) if (m := re.match(r"fills: (\d+)", e))]
            ok &= row["storage_failures"] > 0 or (name == "tmpfs" and bool(fills) and fills[0] > 0)
    for counts in results.get("corrupt", {}).get("outcomes", {}).values():
        ok &= set(counts) <= {"resumed, reference weights", "refused (one line naming the file)"}
    if "fuzz" in results:
        f = results["fuzz"]
        ok &= f.get("unknown", 1) == 0 and f.get("aggregator_alive", False) and f["live_run"]["identical"]
        trust = f.get("trust", {})
        ok &= bool(trust.get("all_refused")) and bool(trust.get("global_model_identical"))
    return bool(ok)


def report(results: dict[str, Any]) -> str:
    """The figures as text."""
    lines = [f"== fault campaign ({results['seconds']} s, load average {results['load_average_start'][0]:.1f} at "
             f"the start, {results['load_average_end'][0]:.1f} at the end)"]
    if "kills" in results:
        rows = results["kills"].values()
        lines.append(f"kills: {sum(r['kills'] for r in rows)} kills in {len(rows)} runs, "
                     f"{sum(r['restarts'] for r in rows)} restarts, "
                     f"{sum(len(r['restart_failures']) for r in rows)} failed restarts, "
                     f"{sum(r['acked'] for r in rows)} acknowledged pushes, {sum(r['lost'] for r in rows)} lost, "
                     f"{sum(r['identical'] for r in rows)}/{len(rows)} runs with the reference weights")
    if "disk" in results:
        rows = [r for r in results["disk"].values() if isinstance(r, dict)]
        lines.append(f"disk: {len(rows)} runs, {sum(r['storage_failures'] for r in rows)} failed writes, "
                     f"{sum(r['acked'] for r in rows)} acknowledged pushes, {sum(r['lost'] for r in rows)} lost, "
                     f"{sum(r['finished'] for r in rows)}/{len(rows)} finished, "
                     f"{sum(r['identical'] for r in rows)}/{len(rows)} with the reference weights")
    if "corrupt" in results:
        total: Counter[str] = Counter()
        for c in results["corrupt"]["outcomes"].values():
            total.update(c)
        lines.append(f"corrupt: {dict(total)}")
    if "fuzz" in results and "codes" in results["fuzz"]:
        f = results["fuzz"]
        lines.append(f"fuzz: {f['messages']} messages in {f['seconds']} s, UNKNOWN {f['unknown']}, alive "
                     f"{f['aggregator_alive']}, live run identical {f['live_run']['identical']}, RSS KiB "
                     f"{f['rss_kib']}, codes {f['codes']}")
        t = f.get("trust", {})
        lines.append(f"trust: all refused with their reason {t.get('all_refused')}, global model as without them "
                     f"{t.get('global_model_identical')}; certificates {t.get('certificates')}; values "
                     f"{t.get('values')}" if "error" not in t else f"trust: {t['error']}")
    if "leak" in results and "aggregator" in results["leak"]:
        lk = results["leak"]
        lines.append(f"leak: aggregator {lk['aggregator']['bytes_per_request']} B/request "
                     f"({lk['aggregator']['codes']}), bare grpcio {lk['grpcio']} sync server "
                     f"{lk['bare_grpcio_sync_server']['bytes_per_request']} B/request "
                     f"({lk['bare_grpcio_sync_server']['codes']})")
    lines.append(f"verdict: {'PASS' if verdict(results) else 'FAIL'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
