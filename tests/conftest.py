"""Shared fixtures: an in-process aggregator on loopback and a numpy-only raw client that speaks its gRPC."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.journal.store import Disk
from hetfed.aggregator.serving.server import RunningAggregator, start_aggregator
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks, codec
from hetfed.wire.payloads import Payload, PayloadKind
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY
from tests.faults import FaultyDisk

REPO = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> ModuleType:
    """Import benchmarks/<name>.py (the benchmarks folder is scripts, not a package)."""
    return _load_file(name, REPO / "benchmarks" / f"{name}.py")


def load_script(name: str) -> ModuleType:
    """Import scripts/<name>.py (the scripts folder is not a package)."""
    return _load_file(name, REPO / "scripts" / f"{name}.py")


def _load_file(name: str, path: Path) -> ModuleType:
    """Import the module at ``path`` as ``name``, once (later calls return the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_pids(pid: int) -> list[int]:
    """The children of ``pid``, started by any of its threads (Linux /proc children lists). A thread that exits
    between the listing and the read is skipped; a ``pid`` that is gone has none."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def process_alive(pid: int) -> bool:
    """``pid`` is running: it has a /proc entry and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02, what: str = "") -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def aggregator_processes(tmp_path: Path, run: dict[str, Any]) -> Iterator[Callable[[], tuple[Any, int]]]:
    """A fixture's body: start (and restart) a real ``hetfed aggregator`` process hosting ``run``, on one port and
    one state directory; each start waits for its ready file. Every process still alive is killed at the end."""
    port = free_port()
    cfg = {"server": {"listen": f"127.0.0.1:{port}", "metrics_port": -1, "state_dir": str(tmp_path / "state")},
           "runs": [run]}
    (tmp_path / "agg.json").write_text(json.dumps(cfg))
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], int]:
        ready = tmp_path / "ready"
        ready.unlink(missing_ok=True)
        log = open(tmp_path / f"agg{len(procs)}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(tmp_path / "agg.json"),
                              "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        wait_until(lambda: ready.exists() or p.poll() is not None, timeout=60, what="the aggregator to start")
        assert p.poll() is None, (tmp_path / f"agg{len(procs) - 1}.log").read_text()
        return p, port

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


class GatedDisk(FaultyDisk):
    """Counts the fsyncs of files whose name contains ``file``; once ``arm()``ed, the next one waits for
    ``gate`` (so other work can arrive while it runs, ``entered`` says it has begun) and fails with EIO when
    armed with ``fail``."""

    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fsyncs = 0
        self.armed = False
        self.fail = False

    def arm(self, fail: bool = False) -> None:
        self.fsyncs, self.armed, self.fail = 0, True, fail

    def fsync(self, fd: int) -> None:
        if self.file not in self._names.get(fd, ""):
            return super().fsync(fd)
        self.fsyncs += 1
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.gate.wait(timeout=30)
            if self.fail:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().fsync(fd)


def denied(push: Callable[[], object]) -> str:
    """The details of the PERMISSION_DENIED refusal that ``push`` draws (a payload kind a contract does not declare)."""
    with pytest.raises(grpc.RpcError) as err:
        push()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    return str(err.value.details())


def run_config(**overrides: Any) -> dict[str, Any]:
    """A run config mapping with small defaults."""
    cfg: dict[str, Any] = {"id": "r", "algorithm": "fedavg", "organizations": ["a", "b"], "rounds": 2}
    cfg.update(overrides)
    return cfg


class RawClient:
    """A numpy-only client that builds every message by hand (to send good and bad ones)."""

    def __init__(self, port: int, organization: str, run: str = "r", *, header: str | None = None) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = agrpc.AggregatorStub(self.channel)
        self.organization = organization
        self.run = run
        name = organization if header is None else header
        self.metadata = ((ORGANIZATION_METADATA_KEY, name),) if name else ()

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def join(self, declared: list[tuple[PayloadKind, str, np.ndarray]] | None = None,
             organization: str | None = None, examples: int = 0) -> apb.JoinResponse:
        """Join, declaring ``declared`` tensors (and ``examples`` training examples)."""
        req = apb.JoinRequest(run_id=self.run, organization_id=self.organization if organization is None else organization,
                              num_train_examples=examples)
        for kind, name, arr in declared or []:
            req.declared_tensors.add(payload_kind=kind.proto_enum, name=name,
                                     dtype=codec._WIRE[codec.wire_dtype_of(arr)][0], shape=arr.shape)
        return self.stub.Join(req, metadata=self.metadata, timeout=10)

    def pull(self, completed: int = -1, wait: float = 5.0) -> apb.Instructions:
        """Long-poll for instructions and reassemble them."""
        req = apb.PullInstructionsRequest(run_id=self.run, organization_id=self.organization,
                                          completed_round=completed, wait_seconds=wait)
        asm = chunks.Reassembler(1 << 40)
        for resp in self.stub.PullInstructions(req, metadata=self.metadata, timeout=wait + 10):
            asm.add(resp.chunk)
        return apb.Instructions.FromString(asm.data())

    def update_bytes(self, round_: int, payloads: list[Payload], *, envelope: apb.Envelope | None = None,
                     wire_dtype: str | None = None) -> bytes:
        """A serialized Update with a correct envelope unless one is given."""
        messages = [codec.payload_to_proto(p, wire_dtype) for p in payloads]
        env = envelope or apb.Envelope(run_id=self.run, round=round_, organization_id=self.organization,
                                       payload_kinds=[p.kind.proto_enum for p in payloads])
        return apb.Update(envelope=env, payloads=messages).SerializeToString()

    def push_bytes(self, round_: int, data: bytes, *, chunk_bytes: int = 1 << 20,
                   tamper: Callable[[list[apb.Chunk]], list[apb.Chunk]] | None = None,
                   organization: str | None = None) -> apb.PushUpdateResponse:
        """Push raw update bytes as chunks (optionally tampered with)."""
        parts = list(chunks.split(data, chunk_bytes))
        if tamper is not None:
            parts = tamper(parts)
        org = self.organization if organization is None else organization
        reqs = [apb.PushUpdateRequest(run_id=self.run, round=round_, organization_id=org, chunk=c) for c in parts]
        return self.stub.PushUpdate(iter(reqs), metadata=self.metadata, timeout=30)

    def push(self, round_: int, payloads: list[Payload], **kw: Any) -> apb.PushUpdateResponse:
        """Push a well-formed update of ``payloads``."""
        return self.push_bytes(round_, self.update_bytes(round_, payloads), **kw)


@pytest.fixture
def aggregator(tmp_path: Path) -> Iterator[Callable[..., RunningAggregator]]:
    """Factory: start an in-process aggregator hosting the given runs (on one state directory per test, so a
    second start resumes the first's state; ``disk`` replaces the store's file layer); stopped after the test."""
    started: list[RunningAggregator] = []

    def start(*runs: dict[str, Any], disk: Disk | None = None, **server: Any) -> RunningAggregator:
        cfg = aggregator_config_from_mapping({
            "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(tmp_path / "state"), **server},
            "runs": list(runs) or [run_config()],
        })
        agg = start_aggregator(cfg, disk)
        started.append(agg)
        return agg

    yield start
    for agg in started:
        agg.stop(grace=0.5)


@pytest.fixture
def raw_client() -> Iterator[Callable[..., RawClient]]:
    """Factory of RawClients, closed after the test."""
    made: list[RawClient] = []

    def make(port: int, organization: str, run: str = "r", **kw: Any) -> RawClient:
        c = RawClient(port, organization, run, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
