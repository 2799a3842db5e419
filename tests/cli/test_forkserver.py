"""The fork server: children run ``hetfed ARGV`` with their own log, directory and environment; their exit
status reaches the orchestrator; they can be stopped; the server never opened gRPC before forking."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetfed.cli.forkserver import ForkServer


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    forks = ForkServer(env, tmp_path / "forkserver.log")
    yield forks
    forks.close()


def test_a_child_runs_the_command_in_its_directory_and_reports_its_status(server: ForkServer, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HETFED_TEST_MARK": "child"}
    ok = server.spawn("certs", ["certs", "--out", "pem", "--organizations", "a,b"], tmp_path / "certs.log", work, env)
    assert ok.wait(timeout=120) == 0
    assert sorted(p.name for p in (work / "pem").iterdir()) == [
        "a-key.pem", "a.pem", "aggregator-key.pem", "aggregator.pem", "b-key.pem", "b.pem", "ca-key.pem", "ca.pem"]
    assert "aggregator:" in (tmp_path / "certs.log").read_text()  # its stdout went to its own log
    bad = server.spawn("bad", ["run", "--clients", "0"], tmp_path / "bad.log", work, env)
    assert bad.wait(timeout=120) == 2
    assert (tmp_path / "bad.log").read_text().strip() == (
        "hetfed run: error: argument --clients: --clients must be greater than 0, got 0 (see hetfed run --help)")


def test_a_child_can_be_stopped_and_the_server_exits_when_closed(server: ForkServer, tmp_path: Path) -> None:
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(f'[server]\nlisten = "127.0.0.1:0"\nmetrics_port = -1\nstate_dir = "{tmp_path / "state"}"\n'
                   '[[runs]]\nid = "r"\nalgorithm = "local"\norganizations = ["a"]\n')
    ready = tmp_path / "ready.json"
    child = server.spawn("agg", ["aggregator", "--config", str(cfg), "--ready-file", str(ready)], tmp_path / "a.log",
                         tmp_path, dict(os.environ))
    deadline = time.monotonic() + 120
    while not ready.exists():  # serving (a loaded machine may take a while to import and start)
        assert child.poll() is None and time.monotonic() < deadline, (tmp_path / "a.log").read_text()[-2000:]
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)  # a serving aggregator keeps running
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 0  # a graceful stop
    server.close()
    assert not server.alive()


def test_the_server_imports_torch_but_opens_no_grpc_before_forking() -> None:
    """Forking is safe only if no gRPC channel, server or thread pool exists: the server's preload creates none."""
    script = (
        "import os, sys\n"
        "from hetfed.cli.forkserver import _preload\n"
        "_preload([{'dataset': 'digits', 'partition': 'iid', 'num_clients': 2}])\n"
        "assert 'torch' in sys.modules and 'hetfed.client.runtime' in sys.modules\n"
        "threads = os.listdir('/proc/self/task')\n"  # every OS thread: a gRPC or OpenMP pool would show here
        "assert len(threads) == 1, threads\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr
