"""Memory of refused, stalled and cancelled pushes goes back to the system at once (a real aggregator process).

Stalled 64 MB pushes, more than the admission limit lets in at once, are refused (``stalled``); the
aggregator's resident memory (``/proc/<pid>/status``) must be back within 10% of its level before the attack
within 5 s of the last stream's end, and never above ``max_concurrent_reassemblies`` × the largest admitted
push, plus what each waiting push holds in gRPC's windows, plus ``PEAK_OVERHEAD_BYTES``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from hetfed.aggregator.config import ServerConfig
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY
from tests.conftest import RawClient, free_port, wait_until

ORGS = [f"o{i}" for i in range(6)]
SLOTS = 2  # server.max_concurrent_reassemblies
ANNOUNCED = 64 << 20  # each push announces 64 MB ...
SENT = 48  # ... sends 48 chunks of 1 MiB, then stalls
CHUNK = 1 << 20
# What the aggregator may hold besides the reassembly buffers while the pushes stall: gRPC's read buffers, the
# chunk being copied, the allocator's slack (docs/reliability.md, "Memory of refused pushes") ...
PEAK_OVERHEAD_BYTES = 48 << 20
# ... and what each push waiting for a slot gets into gRPC's buffers: about two stream windows, and the message
# being read (docs/benchmarks.md, "What the stream window costs a push").
WAITING_PUSH_BYTES = 2 * ServerConfig().stream_window_bytes + CHUNK


def rss(pid: int) -> int:
    """Resident bytes of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settled_rss(pid: int) -> int:
    """Resident bytes once two readings 0.2 s apart differ by less than 1%."""
    last = [rss(pid)]

    def settled() -> bool:
        now = rss(pid)
        same = abs(now - last[0]) < last[0] / 100
        last[0] = now
        return same

    wait_until(settled, timeout=20, interval=0.2, what="the aggregator's memory to settle")
    return last[0]


@pytest.fixture
def aggregator_pid(tmp_path: Path) -> Iterator[tuple[int, int]]:
    port = free_port()
    cfg = {
        "server": {"listen": f"127.0.0.1:{port}", "metrics_port": -1, "state_dir": str(tmp_path / "state"),
                   "max_concurrent_reassemblies": SLOTS, "push_idle_seconds": 1.5, "reassembly_wait_seconds": 60},
        "runs": [{"id": "r", "algorithm": "fedavg", "organizations": ORGS, "rounds": 2}],
    }
    (tmp_path / "agg.json").write_text(json.dumps(cfg))
    ready = tmp_path / "ready"
    with open(tmp_path / "agg.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(tmp_path / "agg.json"),
                              "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: ready.exists() or p.poll() is not None, timeout=60, what="the aggregator to start")
        assert p.poll() is None, (tmp_path / "agg.log").read_text()
        yield p.pid, port
    finally:
        p.kill()
        p.wait()


def _stalled_push(port: int, org: str, release: threading.Event, results: dict[str, object], cancel: bool) -> None:
    """A push announcing ANNOUNCED bytes that sends SENT chunks and then nothing until ``release`` (or that the
    client cancels once they are sent, with ``cancel``)."""
    count = ANNOUNCED // CHUNK
    data = b"\x01" * CHUNK
    sent = threading.Event()

    def requests() -> Iterator[apb.PushUpdateRequest]:
        for i in range(SENT):
            yield apb.PushUpdateRequest(run_id="r", round=1, organization_id=org, chunk=apb.Chunk(
                index=i, count=count, total_bytes=ANNOUNCED, data=data))
        sent.set()
        release.wait(120)

    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        call = agrpc.AggregatorStub(ch).PushUpdate.future(requests(), metadata=((ORGANIZATION_METADATA_KEY, org),),
                                                          timeout=120)
        if cancel and sent.wait(60):
            call.cancel()
        try:
            call.result()
            results[org] = "accepted"
        except grpc.FutureCancelledError:
            results[org] = "cancelled"
        except grpc.RpcError as err:
            results[org] = err.details() or ""


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["stalled", "cancelled"])
def test_refused_and_cancelled_pushes_give_their_memory_back(aggregator_pid: tuple[int, int], how: str) -> None:
    pid, port = aggregator_pid
    decl = [(PayloadKind.MODEL_WEIGHTS, "w", np.zeros(3, np.float32))]
    for org in ORGS:
        client = RawClient(port, org)
        client.join(decl)
        client.close()
    baseline = settled_rss(pid)
    release = threading.Event()
    results: dict[str, object] = {}
    threads = [threading.Thread(target=_stalled_push, args=(port, org, release, results, how == "cancelled")) for org in ORGS]
    for t in threads:
        t.start()
    peak = baseline
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss(pid))
        time.sleep(0.01)
        if len(results) == len(ORGS):
            break
    release.set()
    for t in threads:
        t.join(30)
    ended = time.monotonic()
    assert all(isinstance(r, str) and r.startswith(how) for r in results.values()), results
    trace = []
    while True:
        now = rss(pid)
        trace.append((round(time.monotonic() - ended, 2), now >> 20))
        if now <= baseline * 1.10 or time.monotonic() - ended > 5.0:
            break
        time.sleep(0.05)
    print(f"{how}: baseline {baseline >> 20} MiB, peak {peak >> 20} MiB, after: {trace[-5:]}")
    waiting = (len(ORGS) - SLOTS) * WAITING_PUSH_BYTES
    assert peak <= baseline + SLOTS * ANNOUNCED + waiting + PEAK_OVERHEAD_BYTES, (baseline >> 20, peak >> 20)
    assert now <= baseline * 1.10, f"RSS {now >> 20} MiB 5 s after the last stream, baseline {baseline >> 20} MiB"
