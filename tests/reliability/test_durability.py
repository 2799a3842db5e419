"""Restarts from any state, and no acknowledged update lost through disk faults (docs/reliability.md).

Each test drives a real aggregator over gRPC; disk faults come from the store's injectable file layer
(``FaultyDisk``), restarts start a new aggregator on the same state directory (a real process where the
command line is what is tested).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.journal.store import StateError
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import AggregatorClient, RemoteError
from tests.conftest import GatedDisk, RawClient, run_config, wait_until
from tests.faults import DiskFault, FaultyDisk

W = np.array([1.0, 2.0, 4.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]
Start = Callable[..., Any]
Clients = Callable[..., RawClient]


def upd(scale: float, n: int = 1) -> list[Any]:
    return [ModelWeights({"w": W * scale}, n), EvalMetrics(test_accuracy=0.5, num_test_examples=1)]


def joined(port: int, raw_client: Clients, orgs: str = "ab") -> list[RawClient]:
    out = [raw_client(port, o) for o in orgs]
    for c in out:
        c.join(DECL)
    return out


def weights(ins: apb.Instructions) -> np.ndarray:
    mw = codec.payload_from_proto(ins.payloads[0])
    assert isinstance(mw, ModelWeights)
    return mw.tensors["w"]


def history_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "state" / "r" / "history.jsonl").read_text().splitlines()]


def storage_errors(agg: Any) -> float:
    return agg.service.metrics.registry.get_sample_value("hetfed_storage_errors_total", {"run": "r"}) or 0.0


# ------------------------------------------------------------------------------------------ 1 and 2


def test_1_a_finished_run_restarts_finished_every_time(aggregator: Start, raw_client: Clients,
                                                        tmp_path: Path) -> None:
    agg = aggregator(run_config(rounds=1))
    a, b = joined(agg.port, raw_client)
    for c in (a, b):
        c.push(1, upd(1.0))
    for c in (a, b):
        assert c.pull(completed=1).action == apb.ACTION_EVALUATE
        c.push(2, [EvalMetrics(test_accuracy=0.9, num_test_examples=1)])
    agg.stop()
    for _ in range(2):  # every later start of the finished run's state, not only the first
        agg = aggregator(run_config(rounds=1))
        c = raw_client(agg.port, "a")
        assert c.pull(completed=-1).action == apb.ACTION_FINISH
        status = c.stub.Status(apb.StatusRequest(run_id="r"), timeout=5).runs[0]
        assert status.state == apb.RUN_STATE_FINISHED and [h.round for h in status.history] == [1, 2]
        with pytest.raises(grpc.RpcError) as err:
            c.push(2, [EvalMetrics()])
        assert "run 'r' has finished" in err.value.details()
        agg.stop()
    assert (tmp_path / "state" / "r" / "updates.wal").stat().st_size == 24  # no evaluate record kept


def test_2_a_restart_closes_a_round_whose_every_update_is_logged(aggregator: Start, raw_client: Clients,
                                                                 tmp_path: Path) -> None:
    disk = FaultyDisk()
    agg = aggregator(run_config(), disk=disk)
    a, b = joined(agg.port, raw_client)
    disk.add(DiskFault("pwrite", "checkpoint.npz", times=-1))  # every close's checkpoint fails
    assert a.push(1, upd(1.0)).accepted
    assert b.push(1, upd(3.0)).accepted
    run = agg.service.runs["r"]
    # The close's history line is durable, its checkpoint (the commit point) is not: the next round's pushes
    # are refused with a retryable status until it is.
    wait_until(lambda: run.journal.commit_error, timeout=10, what="the close's checkpoint to fail")
    assert run.has_pending_commit()
    with pytest.raises(grpc.RpcError) as err:
        a.push(2, upd(1.0))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "round 1's checkpoint is not on disk yet" in err.value.details()
    agg.stop()
    # The restore closes the round (it crashed with "cannot notify on un-acquired lock").
    agg = aggregator(run_config())
    assert agg.service.runs["r"].round == 2
    c = raw_client(agg.port, "a")
    ins = c.pull(completed=1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    np.testing.assert_array_equal(weights(ins), W * 2.0)
    assert [h["round"] for h in history_lines(tmp_path)] == [1]


# ------------------------------------------------------------------------------------------ 3 and 5


def test_3_5_a_failed_append_is_retryable_and_loses_no_later_acknowledged_update(
        aggregator: Start, raw_client: Clients) -> None:
    disk = FaultyDisk()
    agg = aggregator(run_config(organizations=["a", "b", "c"]), disk=disk)
    a, b, _ = joined(agg.port, raw_client, "abc")
    disk.add(DiskFault("pwrite", "updates.wal", partial=0.5))  # ENOSPC after half the record
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, upd(1.0))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # was UNKNOWN (an unhandled OSError)
    assert err.value.details().startswith("storage_unavailable: could not log the update of 'a' for round 1")
    assert storage_errors(agg) == 1
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as typed:  # what the client runtime sees
        disk.add(DiskFault("fsync", "updates.wal"))
        with pytest.raises(RemoteError) as remote:
            typed.push(1, upd(1.0))
        assert (remote.value.reason, remote.value.retryable) == ("storage_unavailable", True)
    assert b.push(1, upd(2.0, 2)).accepted  # acknowledged after the failures
    agg.stop()
    agg = aggregator(run_config(organizations=["a", "b", "c"]))
    assert sorted(agg.service.runs["r"].pushed) == ["b"]  # b's acknowledged update survived the torn append
    a, c = raw_client(agg.port, "a"), raw_client(agg.port, "c")
    assert a.push(1, upd(1.0)).accepted  # a retries
    c.push(1, upd(7.0))
    ins = c.pull(completed=1)
    np.testing.assert_array_equal(weights(ins), W * (1 + 4 + 7) / 4)


# ------------------------------------------------------------------------------------------ 4


@pytest.mark.parametrize("file", ["history.jsonl", "checkpoint.npz"])
def test_4_a_close_that_cannot_be_written_is_retried_without_duplicating_history(
        aggregator: Start, raw_client: Clients, tmp_path: Path, file: str) -> None:
    disk = FaultyDisk()
    agg = aggregator(run_config(rounds=3), disk=disk)
    a, b = joined(agg.port, raw_client)
    for c in (a, b):
        c.push(1, upd(1.0))
    run = agg.service.runs["r"]
    # Round 1's checkpoint is written in the background once its close is acknowledged: let it land first.
    wait_until(lambda: run.round == 2 and not run.has_pending_commit(), timeout=10, what="round 1's checkpoint")
    fault = disk.add(DiskFault("pwrite", file, times=-1))
    assert a.push(2, upd(1.0)).accepted
    assert b.push(2, upd(3.0)).accepted  # acknowledged although its close cannot be written
    wait_until(lambda: disk.failed >= 4 and storage_errors(agg) >= 4, timeout=10,
               what="the deadline ticker to retry the close (each failure counted)")
    if file == "history.jsonl":  # the close itself failed: the round stays open
        assert run.round == 2 and len(run.history) == 1 and sorted(run.pushed) == ["a", "b"]
    else:  # the history line is durable and the run went on in memory; its checkpoint waits for space
        assert run.round == 3 and len(run.history) == 2 and run.has_pending_commit()
    disk.faults.remove(fault)  # space returns
    wait_until(lambda: run.round == 3 and not run.has_pending_commit(), timeout=10, what="the retried close")
    assert [h["round"] for h in history_lines(tmp_path)] == [1, 2] and len(run.history) == 2
    ins = a.pull(completed=2)
    np.testing.assert_array_equal(weights(ins), W * 2.0)  # the half rebuilt from disk: nothing applied twice
    agg.stop()
    agg = aggregator(run_config(rounds=3))  # no crash loop: the checkpoint and the history agree
    assert agg.service.runs["r"].round == 3 and len(agg.service.runs["r"].history) == 2
    np.testing.assert_array_equal(weights(raw_client(agg.port, "b").pull(completed=2)), W * 2.0)


def test_4_a_join_that_cannot_be_written_changes_nothing(aggregator: Start, raw_client: Clients) -> None:
    disk = FaultyDisk()
    agg = aggregator(run_config(), disk=disk)
    disk.add(DiskFault("fsync", "checkpoint.npz"))
    a = raw_client(agg.port, "a")
    with pytest.raises(grpc.RpcError) as err:
        a.join(DECL)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert agg.service.runs["r"].joined == set()
    a.join(DECL)
    assert agg.service.runs["r"].joined == {"a"}


# ------------------------------------------------------------------------------------------ 6


def test_6_a_truncated_checkpoint_is_refused_naming_the_file(aggregator: Start, raw_client: Clients,
                                                             tmp_path: Path) -> None:
    agg = aggregator(run_config())
    joined(agg.port, raw_client)
    agg.stop()
    ckpt = tmp_path / "state" / "r" / "checkpoint.npz"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(StateError, match=r"run 'r': .*checkpoint.npz cannot be read \(BadZipFile"):
        aggregator(run_config())


def test_6_a_missing_checkpoint_is_not_a_new_run(aggregator: Start, raw_client: Clients, tmp_path: Path) -> None:
    agg = aggregator(run_config())
    for c in joined(agg.port, raw_client):
        c.push(1, upd(1.0))
    agg.stop()
    (tmp_path / "state" / "r" / "checkpoint.npz").unlink()
    with pytest.raises(StateError, match=r"checkpoint\.npz is missing, but history\.jsonl holds closed rounds"):
        aggregator(run_config())


def test_6_a_torn_last_history_line_is_repaired(aggregator: Start, raw_client: Clients, tmp_path: Path) -> None:
    agg = aggregator(run_config(rounds=3))
    for c in joined(agg.port, raw_client):
        c.push(1, upd(1.0))
    agg.stop()
    path = tmp_path / "state" / "r" / "history.jsonl"
    path.write_bytes(path.read_bytes()[:-7])
    agg = aggregator(run_config(rounds=3))
    assert [h.round for h in agg.service.runs["r"].history] == [1]
    assert [h["round"] for h in history_lines(tmp_path)] == [1]


def test_6_a_flipped_byte_in_the_first_record_loses_only_that_update_which_is_asked_for_again(
        aggregator: Start, raw_client: Clients, tmp_path: Path) -> None:
    agg = aggregator(run_config(organizations=["a", "b", "c"]))
    a, b, _ = joined(agg.port, raw_client, "abc")
    assert a.push(1, upd(1.0)).accepted
    assert b.push(1, upd(2.0)).accepted
    agg.stop()
    log = tmp_path / "state" / "r" / "updates.wal"
    blob = bytearray(log.read_bytes())
    blob[24 + 70 + 1 + 10] ^= 0xFF  # inside a's update, the first record
    log.write_bytes(bytes(blob))
    agg = aggregator(run_config(organizations=["a", "b", "c"]))
    assert sorted(agg.service.runs["r"].pushed) == ["b"]  # b's record, after the damaged one, is kept
    a, c = raw_client(agg.port, "a"), raw_client(agg.port, "c")
    # a holds an acknowledgement for round 1; it is asked for round 1 again instead of waiting forever.
    ins = a.pull(completed=1, wait=1.0)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1
    a.push(1, upd(1.0))
    c.push(1, upd(3.0))
    np.testing.assert_array_equal(weights(c.pull(completed=1)), W * 2.0)


def test_6_the_command_refuses_damaged_state_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state" / "r"
    state.mkdir(parents=True)
    (state / "history.jsonl").write_text('{"round": 1}\n')
    cfg = {"server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(tmp_path / "state")},
           "runs": [run_config()]}
    (tmp_path / "agg.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(tmp_path / "agg.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    # Log lines (e.g. "Kubernetes Events are off") may come first; the refusal is one line, the last, no traceback.
    refusal = proc.stderr.strip().splitlines()[-1]
    assert refusal.startswith("hetfed aggregator: run 'r': ") and "checkpoint.npz is missing" in refusal
    assert "Traceback" not in proc.stderr


def test_the_next_round_is_served_while_the_closed_rounds_checkpoint_is_written(
        aggregator: Start, raw_client: Clients, tmp_path: Path) -> None:
    """The close acknowledges and wakes its clients before its checkpoint is on disk; the next round's pushes
    wait for that checkpoint (so the log never mixes rounds) and then go through."""
    disk = GatedDisk("checkpoint")
    agg = aggregator(run_config(rounds=3), disk=disk)
    a, b = joined(agg.port, raw_client)
    disk.arm()
    assert a.push(1, upd(1.0)).accepted
    assert b.push(1, upd(3.0)).accepted  # closes round 1: acknowledged while its checkpoint is held
    assert disk.entered.wait(timeout=10)
    run = agg.service.runs["r"]
    assert run.has_pending_commit()
    ins = a.pull(completed=1)  # the next round's instructions do not wait for the checkpoint
    assert ins.envelope.round == 2
    np.testing.assert_array_equal(weights(ins), W * 2.0)
    assert [h["round"] for h in history_lines(tmp_path)] == [1]  # the line is durable, not yet counted
    pushed: list[Any] = []
    waiting = threading.Thread(target=lambda: pushed.append(a.push(2, upd(5.0))))
    waiting.start()
    wait_until(lambda: len(run.journal.committed._waiters) == 1, timeout=10,  # type: ignore[attr-defined]
               what="round 2's push to wait for round 1's checkpoint")
    assert not pushed
    disk.gate.set()
    waiting.join(timeout=30)
    assert pushed and pushed[0].accepted and not run.has_pending_commit()
    agg.stop()
    agg = aggregator(run_config(rounds=3))  # the restart sees round 2 with a's logged update
    assert agg.service.runs["r"].round == 2 and sorted(agg.service.runs["r"].pushed) == ["a"]
