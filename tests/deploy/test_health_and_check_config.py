"""``hetfed health`` (the image's own check), the plaintext health listener under mTLS, and ``--check-config``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.cli import main as hetfed_main
from hetfed.cli.certs import make_federation_certs
from hetfed.wire.traffic import KindCount, TrafficBreakdown
from hetfed.wire.transport import Health
from tests.conftest import child_pids, free_port, process_alive, run_config, wait_until

REPO_EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_health_listener_answers_plaintext_while_grpc_needs_a_certificate(
    tmp_path: Path, aggregator: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Under mTLS: the kubelet-style plaintext probe is SERVING, the gRPC port refuses it, the operator sees Status."""
    certs = make_federation_certs(tmp_path / "certs", ["a", "b", "hetfed-operator"])
    tls = certs.aggregator_tls()
    health_port = free_port()
    agg = aggregator(run_config(id="demo"), health_listen=f"127.0.0.1:{health_port}",
                     tls={"cert": tls.cert, "key": tls.key, "ca": tls.ca}, operators=["hetfed-operator"])
    assert hetfed_main(["health", f"127.0.0.1:{health_port}"]) == 0
    assert capsys.readouterr().out == f"127.0.0.1:{health_port} hetfed.v1.Aggregator: SERVING\n"
    assert hetfed_main(["health", f"127.0.0.1:{agg.port}", "--timeout", "3"]) == 1
    assert "health check failed: UNAVAILABLE" in capsys.readouterr().err
    op_cert, op_key = certs.organizations["hetfed-operator"]
    assert hetfed_main(["health", f"localhost:{agg.port}", "--status", "--tls-cert", str(op_cert),
                        "--tls-key", str(op_key), "--tls-ca", str(certs.ca)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"localhost:{agg.port} hetfed.v1.Aggregator: SERVING",
        "run demo (fedavg): train, round 1 of 2, 2 organizations",
    ]
    # A graceful stop flips the listener to NOT_SERVING before the gRPC port drains.
    agg._health.enter_graceful_shutdown()
    assert hetfed_main(["health", f"127.0.0.1:{health_port}"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_health_of_nothing_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    """No server at the address: exit 1 and the gRPC status."""
    assert hetfed_main(["health", f"127.0.0.1:{free_port()}", "--timeout", "2"]) == 1
    assert "health check failed: UNAVAILABLE" in capsys.readouterr().err


def test_check_config_accepts_the_examples_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/examples pass; the summary names runs, organization, partition and model."""
    assert hetfed_main(["aggregator", "--config", str(REPO_EXAMPLES / "aggregator.toml"), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "aggregator config OK: listen 0.0.0.0:50051 (plaintext); runs mnist-fedavg (fedavg, 3 organizations, 20 rounds)" in out
    assert hetfed_main(["client", "--config", str(REPO_EXAMPLES / "client.toml"), "--check-config"]) == 0
    assert "client config OK: organization hospital-a in run mnist-fedavg" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("aggregator", '[[runs]]\nid = "r"\nalgorithm = "fedavg"\norganizations = ["a"]\nrounds = 1.5\n',
         "runs[0].rounds: expected an integer, got 1.5"),
        ("aggregator", '[[runs]]\nid = "r"\nalgorithm = "fedavgg"\norganizations = ["a"]\n', "fedavgg"),
        ("client", 'organization = "a"\nrun = "r"\n[data]\ndatset = "mnist5k"\n',
         "unknown field 'datset' (did you mean 'dataset'?)"),
        ("client", 'organization = "a"\nrun = "r"\n[model]\nname = "lenett"\n',
         "model.name 'lenett' is not an available architecture"),
    ],
    ids=["ill-typed", "unknown-algorithm", "misspelled", "unknown-model"],
)
def test_check_config_refuses_bad_files_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, text: str, message: str
) -> None:
    """A bad file exits 2 with the field's path."""
    f = tmp_path / f"{kind}.toml"
    f.write_text(text)
    assert hetfed_main([kind, "--config", str(f), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetfed {kind}: error:") and message in err and err.count("\n") == 1, err


def test_organization_ledger_counts_and_round_trips() -> None:
    """Bytes per direction, the last accepted round, a checkpoint round trip, one status entry per organization."""
    ledger = OrganizationLedger()
    ledger.count("a", "up", TrafficBreakdown({"model_weights": KindCount(100, 1, 3), "envelope": KindCount(7, 1)}))
    ledger.count("a", "down", TrafficBreakdown({"envelope": KindCount(12, 1)}))
    ledger.pushed("a", 2)
    ledger.pushed("a", 1)  # a replayed older round never moves it back
    restored = OrganizationLedger.from_json(ledger.to_json())
    assert restored.to_json() == {"a": [2, 107, 12]}
    assert [(o.organization, o.joined, o.last_round_pushed, o.bytes_up, o.bytes_down)
            for o in restored.statuses(["a", "b"], joined={"a"})] == [("a", True, 2, 107, 12), ("b", False, -1, 0, 0)]
    assert OrganizationLedger.from_json(None).to_json() == {}


def _check(port: int, timeout: float = 2.0) -> tuple[int, float]:
    """(status, seconds) of one health check of the aggregator service on ``port``."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        t0 = time.perf_counter()
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="hetfed.v1.Aggregator"), timeout=timeout)
        return reply.status, time.perf_counter() - t0


def test_health_listener_answers_while_the_serving_loop_is_busy_and_fails_when_it_stalls(
    aggregator: Callable[..., Any],
) -> None:
    """The listener runs on its own loop: a check is answered at once while the serving loop is blocked, and
    turns NOT_SERVING once the block outlasts ``health_stall_seconds``, SERVING again when the loop runs."""
    health_port = free_port()
    agg = aggregator(run_config(id="demo"), health_listen=f"127.0.0.1:{health_port}", health_stall_seconds=1.0)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _check(health_port)[0] == serving
    release = threading.Event()
    blocked = threading.Event()

    def block() -> None:  # runs on the serving loop and holds it
        blocked.set()
        release.wait(timeout=30)

    agg._loop.call_soon_threadsafe(block)
    try:
        assert blocked.wait(timeout=10)
        status, seconds = _check(health_port)
        assert status == serving and seconds < 0.5  # answered while the serving loop is held
        with pytest.raises(grpc.RpcError) as err:  # the same check on the serving port waits for the loop
            _check(agg.port, timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: _check(health_port)[0] == not_serving, timeout=10, what="NOT_SERVING")
    finally:
        release.set()
    wait_until(lambda: _check(health_port)[0] == serving, timeout=10, what="SERVING again")


def test_health_on_change_carries_every_change() -> None:
    """The serving ``Health`` tells its listeners of every change, the graceful stop included."""
    seen: list[tuple[dict[str, int], bool]] = []
    source = Health()
    source.on_change.append(lambda statuses, down: seen.append((statuses, down)))
    source.set("x", health_pb2.HealthCheckResponse.SERVING)
    assert seen == [({"x": health_pb2.HealthCheckResponse.SERVING}, False)]
    source.enter_graceful_shutdown()
    assert seen[-1] == ({"x": health_pb2.HealthCheckResponse.NOT_SERVING}, True)
    source.set("x", health_pb2.HealthCheckResponse.SERVING)  # nothing revives a stopping service
    assert len(seen) == 2 and source.status("x") == health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_listener_refuses_a_taken_port_and_leaves_no_process(aggregator: Callable[..., Any]) -> None:
    """A listener that cannot bind fails the start with its reason (and its process is gone)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"the health listener on 127.0.0.1:{port} did not start: cannot serve"):
            aggregator(run_config(id="demo"), health_listen=f"127.0.0.1:{port}")
    assert not _listener_pids()


def _listener_pids(parent: int | None = None) -> list[int]:
    """Health listener processes that are children of ``parent`` (this process by default)."""
    out = []
    for pid in child_pids(os.getpid() if parent is None else parent):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hetfed.aggregator.serving.health_listener" in cmd:
            out.append(pid)
    return out


@pytest.mark.e2e
def test_a_killed_aggregator_leaves_no_health_listener(tmp_path: Path) -> None:
    """SIGKILL the aggregator process: its listener notices the parent is gone and exits by itself."""
    port, health_port = free_port(), free_port()
    cfg = {"server": {"listen": f"127.0.0.1:{port}", "metrics_port": -1, "state_dir": str(tmp_path / "state"),
                      "health_listen": f"127.0.0.1:{health_port}"}, "runs": [run_config(id="demo")]}
    (tmp_path / "agg.json").write_text(json.dumps(cfg))
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(tmp_path / "agg.json"),
                             "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(ready.exists, timeout=60, what="the aggregator to serve")
        assert _check(health_port)[0] == health_pb2.HealthCheckResponse.SERVING
        listener = _listener_pids(proc.pid)
        assert len(listener) == 1
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not process_alive(listener[0]), timeout=10, what="the orphaned listener to exit")


def test_the_shared_health_page_falls_back_to_the_temp_directory(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """Where /dev/shm cannot be written, the page goes to the temp directory (the chart mounts one at /tmp)."""
    import tempfile

    from hetfed.aggregator.serving import health_listener

    real = tempfile.mkstemp

    def no_shm(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dir") == "/dev/shm":
            raise PermissionError(13, "Permission denied", "/dev/shm")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(health_listener.tempfile, "mkstemp", no_shm)
    page = health_listener.SharedHealth.create()
    try:
        assert page.path.parent == tmp_path
        page.set_state(health_listener.SERVING)
        page.beat()
        beat, state = health_listener.SharedHealth(page.path, writable=False).read()
        assert state == health_listener.SERVING and beat > 0
    finally:
        page.close(unlink=True)
    assert not page.path.exists()


def test_health_status_shows_a_finished_run_at_its_last_round(
    aggregator: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished 3-round run reports round 4 (its final evaluation) on the wire: shown as round 3 of 3, finished."""
    from hetfed.wire import rpc
    from hetfed.wire.messages import RunStatus
    from hetfed.wire.phases import Phase

    agg = aggregator(run_config(id="demo"))
    runs = [RunStatus("demo", "fedavg", Phase.FINISHED, 4, 3, ("a", "b")),
            RunStatus("next", "fedavg", Phase.EVALUATE, 4, 3, ("a", "b"))]
    monkeypatch.setattr(rpc, "status_of", lambda *a, **k: runs)
    assert hetfed_main(["health", f"127.0.0.1:{agg.port}", "--status"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"127.0.0.1:{agg.port} hetfed.v1.Aggregator: SERVING",
        "run demo (fedavg): round 3 of 3, finished, 2 organizations",
        "run next (fedavg): evaluate, round 3 of 3, 2 organizations",
    ]
