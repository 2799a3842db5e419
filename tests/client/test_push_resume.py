"""A client process killed in the middle of a push resumes that push when it is started again on the same state
directory: it does not work the round again, it sends the very bytes it kept, from the chunks the aggregator holds,
and the run ends as an uninterrupted one does (a real client process, killed with SIGKILL at a crash point, and an
aggregator over real gRPC)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hetfed.client.pending import DATA_NAME, RECORD_NAME
from hetfed.wire import digest as content
from hetfed.wire.messages import RunStatus
from hetfed.wire.payloads import EvalMetrics
from tests.conftest import run_config, wait_until

pytestmark = pytest.mark.e2e

RESUMING = re.compile(r"resuming the push of round (\d+) at chunk (\d+) \((\d+) bytes held\)")
KEPT = re.compile(r"resuming the push of round (\d+) kept by an earlier process \((\d+) bytes, (\d+) chunks\)")
# d_e of the organizations' mlp1: Linear(64, 40000) and the head Linear(40000, 10), 12 MB on the wire in 13 chunks
# (a first chunk of 16 KiB, then 1 MiB ones): the crash point push.half_sent fires when the 7th is taken.
LATENT = 40_000


@pytest.fixture
def client_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``hetfed client`` processes (``crash_at``: a crash point); each one's log is ``<tmp>/<name>.log``."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, cfg: dict[str, Any], crash_at: str = "") -> subprocess.Popen[bytes]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if k != "HETFED_CLIENT_CRASH_AT"}
        if crash_at:
            env["HETFED_CLIENT_CRASH_AT"] = crash_at
        p = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "client", "--config", str(path)],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def client_config(org: str, index: int, port: int, state_dir: Path) -> dict[str, Any]:
    # report_timing: each round's figures carry the process's own CPU and wall seconds, so an update worked again
    # never has the bytes of the first.
    return {"organization": org, "run": "r", "aggregator": f"127.0.0.1:{port}", "threads": 1, "device": "cpu",
            "pull_wait_seconds": 2, "report_timing": True, "state_dir": str(state_dir), "keep_push_from_bytes": 0,
            "data": {"dataset": "digits", "partition": "iid", "num_clients": 2, "client_index": index},
            "model": {"name": "mlp1", "latent_dim": LATENT},
            "retry": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.5}}


TIMING = ("train_cpu_seconds", "train_wall_seconds", "process_cpu_seconds")


def figures(status: RunStatus) -> list[dict[str, tuple[float, ...]]]:
    """Every round's reported figures per organization, but for the timings (which differ from run to run)."""

    def of(m: EvalMetrics) -> tuple[float, ...]:
        return (m.train_loss, m.num_train_examples, m.test_accuracy, m.test_loss, m.num_test_examples,
                *sorted((k, v) for k, v in m.extra.items() if k not in TIMING))

    return [{org: of(m) for org, m in h.reports.items()} for h in status.history]


def test_a_client_killed_mid_push_resumes_the_same_bytes_from_the_chunks_held(
        aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    rounds = 2
    agg = aggregator(run_config(rounds=rounds, round_deadline_seconds=600))
    state = tmp_path / "a-state"
    # a alone: round 1 stays open (b is not started); a dies as its push takes its middle chunk.
    first = client_process("a1", client_config("a", 0, agg.port, state), crash_at="push.half_sent")
    assert first.wait(timeout=180) == -9, (tmp_path / "a1.log").read_text()
    kept = (state / "r" / DATA_NAME).read_bytes()
    assert (state / "r" / RECORD_NAME).exists() and 12 << 20 > len(kept) > 11 << 20
    run = agg.service.runs["r"]
    assert run.round == 1 and run.journal.store.updates(1) == []

    second = client_process("a2", client_config("a", 0, agg.port, state))
    wait_until(lambda: second.poll() is not None or "a" in run.status().pushed_this_round, timeout=180,
               what="a's round 1 to be accepted")
    # The update accepted is the one the killed process began to push, bit for bit, accepted once.
    ((org, logged),) = run.journal.store.updates(1)
    assert org == "a" and content.digest(logged) == content.digest(kept) and logged == kept
    # Pushed from where the aggregator held it: past chunk 0, before the last.
    log2 = (tmp_path / "a2.log").read_text()
    assert KEPT.findall(log2) == [("1", str(len(kept)), "13")]
    ((round_, held, held_bytes),) = RESUMING.findall(log2)
    assert round_ == "1" and 0 < int(held) < 13 and int(held_bytes) > 0
    wait_until(lambda: not any((state / "r" / name).exists() for name in (RECORD_NAME, DATA_NAME)), timeout=60,
               what="the kept push to be removed")

    other = client_process("b", client_config("b", 1, agg.port, tmp_path / "b-state"))
    assert second.wait(timeout=180) == 0, (tmp_path / "a2.log").read_text()
    assert other.wait(timeout=60) == 0, (tmp_path / "b.log").read_text()
    interrupted = run.status()
    assert interrupted.finished and [h.clients for h in interrupted.history] == [2] * (rounds + 1)
    assert agg.service.metrics.duplicates.labels("r")._value.get() == 0

    # The same run, uninterrupted, on a fresh aggregator and fresh state directories: the same figures.
    again = aggregator(run_config(id="r2", rounds=rounds, round_deadline_seconds=600))
    plain = [client_process(f"{o}-plain", {**client_config(o, i, again.port, tmp_path / f"{o}-plain"), "run": "r2"})
             for i, o in enumerate("ab")]
    for p in plain:
        assert p.wait(timeout=180) == 0
    assert figures(again.service.runs["r2"].status()) == figures(interrupted)


# ------------------------------------------------------------------------------------------------ [privacy]
STEPS = 4


def private_config(org: str, index: int, port: int, state_dir: Path) -> dict[str, Any]:
    """A DP client (DP-SGD, σ = 1) whose update is about 0.6 MB: two chunks, far below keep_push_from_bytes' default,
    which [privacy] overrides (every push is kept)."""
    cfg = {**client_config(org, index, port, state_dir), "report_timing": False,
           "model": {"name": "mlp1", "latent_dim": 2000},
           "privacy": {"noise_multiplier": 1.0, "delta": 1e-5, "noise_seed": 7}}
    del cfg["keep_push_from_bytes"]
    return cfg


def private_run(aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]],
                tmp_path: Path, crash_at: str) -> tuple[dict[str, Any], str]:
    """a killed at ``crash_at`` in round 1, started again; b alone after that. a's ledger after the run (2 training
    rounds and the evaluate round) and its second process's log."""
    agg = aggregator(run_config(rounds=2, round_deadline_seconds=600,
                                algorithm_config={"local_steps": STEPS, "batch_size": 16}))
    state = tmp_path / "a-state"
    first = client_process("a1", private_config("a", 0, agg.port, state), crash_at=crash_at)
    assert first.wait(timeout=180) == -9, (tmp_path / "a1.log").read_text()
    second = client_process("a2", private_config("a", 0, agg.port, state))
    other = client_process("b", private_config("b", 1, agg.port, tmp_path / "b-state"))
    assert second.wait(timeout=180) == 0, (tmp_path / "a2.log").read_text()
    assert other.wait(timeout=60) == 0, (tmp_path / "b.log").read_text()
    status = agg.service.runs["r"].status()
    assert status.finished and [h.clients for h in status.history] == [2, 2, 2] and status.refused == ()
    assert not (state / "r" / RECORD_NAME).exists() and not (state / "r" / DATA_NAME).exists()
    return json.loads((state / "r" / "privacy-ledger.json").read_text()), (tmp_path / "a2.log").read_text()


def steps(ledger: dict[str, Any]) -> int:
    """The DP-SGD steps on the ledger (its sampled releases; the example count's release is not sampled)."""
    return sum(c for q, _, c in ledger["releases"] if q < 1)


def test_a_resumed_private_push_is_not_charged_to_the_budget_again(
        aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    ledger, log2 = private_run(aggregator, client_process, tmp_path, "push.half_sent")
    # Two training rounds of STEPS steps each: what an uninterrupted run spends, nothing for the kill.
    assert steps(ledger) == 2 * STEPS
    assert KEPT.findall(log2)[0][0] == "1"
    assert sorted(ledger["rounds"]) == ["1", "2", "3"]


def test_a_round_worked_again_without_a_kept_push_is_charged_as_before(
        aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    # Killed with the update written but not its record: nothing was kept, so round 1 is worked again (as a restart
    # did before pushes were kept) and its new steps are on the ledger beside the first attempt's.
    ledger, log2 = private_run(aggregator, client_process, tmp_path, "pending.update_written")
    assert KEPT.findall(log2) == []
    assert steps(ledger) == 3 * STEPS


def test_a_push_below_keep_push_from_bytes_is_not_kept_and_its_round_is_worked_again(
        aggregator: Callable[..., Any], client_process: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    agg = aggregator(run_config(rounds=1, round_deadline_seconds=600))
    state = tmp_path / "a-state"
    small = {**client_config("a", 0, agg.port, state), "keep_push_from_bytes": 1 << 20,
             "model": {"name": "mlp1", "latent_dim": 2000}}  # 0.6 MB
    assert client_process("a1", small, crash_at="push.half_sent").wait(timeout=180) == -9
    assert not (state / "r").exists()  # nothing kept, no state saved yet
    second = client_process("a2", small)
    other = client_process("b", {**small, "organization": "b", "state_dir": str(tmp_path / "b-state"),
                                 "data": {**small["data"], "client_index": 1}})
    assert second.wait(timeout=180) == 0 and other.wait(timeout=60) == 0
    assert KEPT.findall((tmp_path / "a2.log").read_text()) == []
    assert agg.service.runs["r"].status().finished
