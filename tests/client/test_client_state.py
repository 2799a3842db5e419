"""A client's private state survives its process: killed mid-run and started again on the same state
directory, it resumes with its private model bit-identical, and the run completes (real processes)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hetfed.client.state import StateFile
from tests.conftest import run_config, wait_until

SAVED = re.compile(r"state after round (\d+) saved \(([0-9a-f]{16})\)")
RESUMED = re.compile(r"resumed from \S+ after round (\d+) \(([0-9a-f]{16})\)")


@pytest.fixture
def client_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``hetfed client`` processes; each one's log is ``<tmp>/<name>.log``; killed after the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "client", "--config", str(path)],
                             stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def client_config(org: str, index: int, port: int, state_dir: Path | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"organization": org, "run": "r", "aggregator": f"127.0.0.1:{port}", "threads": 1,
                           "device": "cpu", "pull_wait_seconds": 2,
                           "data": {"dataset": "digits", "partition": "iid", "num_clients": 2, "client_index": index},
                           "model": {"name": "mlp"},
                           "retry": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.5}}
    if state_dir is not None:
        cfg["state_dir"] = str(state_dir)
    return cfg


def test_killed_client_resumes_its_private_model_bit_identical(
        aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    # fedavg_head: each organization's encoder never leaves it, so only the state directory can bring it back.
    agg = aggregator(run_config(algorithm="fedavg_head", rounds=3, round_deadline_seconds=600))
    state = tmp_path / "a-state"
    log_a = tmp_path / "a1.log"
    # a alone: it trains round 1, pushes, saves its state and waits for b (the round stays open); killed there.
    first = client_process("a1", client_config("a", 0, agg.port, state))
    saved = wait_until(lambda: SAVED.findall(log_a.read_text()), timeout=120, what="a to save round 1")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert saved == [("1", saved[0][1])]
    on_disk = StateFile(state, "r", {}).load()
    assert on_disk is not None and on_disk.round == 1 and on_disk.digest == saved[0][1]

    second = client_process("a2", client_config("a", 0, agg.port, state))
    other = client_process("b", client_config("b", 1, agg.port, None))
    assert second.wait(timeout=180) == 0, (tmp_path / "a2.log").read_text()
    assert other.wait(timeout=60) == 0, (tmp_path / "b.log").read_text()
    log2 = (tmp_path / "a2.log").read_text()
    # The restarted process holds, before round 2, exactly the private state the killed one had after round 1.
    assert RESUMED.findall(log2) == [("1", saved[0][1])]
    assert [r for r, _ in SAVED.findall(log2)] == ["2", "3", "4"]  # rounds 2, 3 and the evaluate round
    assert "no state_dir configured; private state starts fresh" in (tmp_path / "b.log").read_text()
    status = agg.service.runs["r"].status()
    assert status.finished and [h.clients for h in status.history] == [2, 2, 2, 2]
    # Started again after the end: a's state says it completed the run (exit 0); b, without state, cannot
    # tell a finished run from a reinstall onto its kept state, and is refused for good (exit 2).
    assert client_process("a3", client_config("a", 0, agg.port, state)).wait(timeout=120) == 0
    assert "run r finished; this organization had completed it" in (tmp_path / "a3.log").read_text()
    assert client_process("b2", client_config("b", 1, agg.port, None)).wait(timeout=120) == 2
    assert "refused 'b' for good (run_finished): run 'r' finished after 4 rounds" in (tmp_path / "b2.log").read_text()


def test_state_of_another_run_is_refused_with_exit_2(
        aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    agg = aggregator(run_config(algorithm="fedavg_head", rounds=1))
    state = tmp_path / "a-state"
    StateFile(state, "r", {"run": "r", "organization": "a", "algorithm": "local", "seed": 0,
                           "model": "mlp"}).save(3, {"model": {}})
    p = client_process("a", client_config("a", 0, agg.port, state))
    assert p.wait(timeout=120) == 2
    lines = [line for line in (tmp_path / "a.log").read_text().splitlines() if line.startswith("hetfed client:")]
    assert len(lines) == 1 and "holds the state of another run: algorithm 'local' (now 'fedavg_head')" in lines[0]
