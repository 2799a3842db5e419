"""Real aggregator processes killed at named points of the write path (HETFED_CRASH_AT) resume correctly.

The full campaign (every point, random kills, full disks, damaged files, fuzzing) is ``benchmarks/faults.py``;
``test_fault_campaign_quick`` runs a small version of it (slow).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.journal.crashpoints import CRASH_POINTS, EXIT_CODE
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from tests.conftest import RawClient, load_benchmark, run_config, wait_until

faults = load_benchmark("faults")
W = np.array([1.0, 2.0, 4.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]


def upd(scale: float) -> list[Any]:
    return [ModelWeights({"w": W * scale}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)]


def test_the_crash_point_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetfed.aggregator.journal import crashpoints

    monkeypatch.setenv("HETFED_CRASH_AT", "no.such.point")
    with pytest.raises(ValueError, match=r"HETFED_CRASH_AT names 'no\.such\.point', not one of wal\.header_written"):
        crashpoints._armed()
    monkeypatch.setenv("HETFED_CRASH_AT", "history.synced:3")
    assert crashpoints._armed() == ("history.synced", 3)
    assert len(set(CRASH_POINTS)) == len(CRASH_POINTS) == 14


@pytest.mark.e2e
def test_killed_between_the_history_line_and_the_checkpoint(tmp_path: Path,
                                                            raw_client: Callable[..., RawClient]) -> None:
    agg = faults.AggregatorProcess(tmp_path, [run_config()])
    assert agg.start(crash_at="history.synced:1") == ""
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for c in (a, b):
        c.join(DECL)
    a.push(1, upd(1.0))
    with pytest.raises(grpc.RpcError):  # the first close: the process dies before b's acknowledgement
        b.push(1, upd(3.0))
    wait_until(lambda: agg.exited() is not None, timeout=30, what="the crash")
    assert agg.exited() == EXIT_CODE
    assert agg.start() == ""
    # The uncounted history line was cut and the round closed again from the log, with b's logged update
    # (b's retry would find round 1 closed: ``late``, which the client runtime passes over).
    status = a.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs[0]
    assert status.round == 2 and [h.round for h in status.history][:1] == [1]
    mw = codec.payload_from_proto(b.pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    np.testing.assert_array_equal(mw.tensors["w"], W * 2.0)
    agg.stop()
    lines = (tmp_path / "state" / "r" / "history.jsonl").read_text().splitlines()
    assert len(lines) == 1


@pytest.mark.e2e
def test_killed_between_two_ranges_of_a_close_folds_the_same_aggregate_again(
        tmp_path: Path, raw_client: Callable[..., RawClient]) -> None:
    from hetfed.aggregator.algorithms.aggregators import FOLD_RANGE, WeightedMean

    rng = np.random.default_rng(8)
    n = 3 * FOLD_RANGE + 5  # above RUNNING_SUM_BYTES: folded at the close, in four ranges
    big = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(np.float32)
    agg = faults.AggregatorProcess(tmp_path, [run_config()])
    assert agg.start(crash_at="close.folding:2") == ""  # after the second of the close's four ranges
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for c in (a, b):
        c.join([(PayloadKind.MODEL_WEIGHTS, "w", big)])
    ups = {"a": big, "b": (big * np.float32(1.0009765625)).astype(np.float32)}
    a.push(1, [ModelWeights({"w": ups["a"]}, 3), EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    with pytest.raises(grpc.RpcError):
        b.push(1, [ModelWeights({"w": ups["b"]}, 5), EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    wait_until(lambda: agg.exited() is not None, timeout=60, what="the crash")
    assert agg.exited() == EXIT_CODE
    assert agg.start() == ""
    expected = WeightedMean()
    expected.add({"w": ups["a"]}, 3.0)
    expected.add({"w": ups["b"]}, 5.0)
    mw = codec.payload_from_proto(b.pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    assert mw.tensors["w"].tobytes() == expected.mean(np.float32)["w"].tobytes()
    agg.stop()


@pytest.mark.e2e
def test_killed_after_an_update_is_durable_but_before_it_is_acknowledged(
        tmp_path: Path, raw_client: Callable[..., RawClient]) -> None:
    agg = faults.AggregatorProcess(tmp_path, [run_config(organizations=["a", "b", "c"])])
    assert agg.start(crash_at="wal.synced:2") == ""
    a, b, c = (raw_client(agg.port, o) for o in "abc")
    for cl in (a, b, c):
        cl.join(DECL)
    assert a.push(1, upd(1.0)).accepted
    with pytest.raises(grpc.RpcError):
        b.push(1, upd(2.0))
    wait_until(lambda: agg.exited() is not None, timeout=30, what="the crash")
    assert agg.start() == ""
    again = b.push(1, upd(2.0))  # the retry finds the durable update: acknowledged as a duplicate
    assert again.accepted and again.duplicate
    c.push(1, upd(3.0))
    mw = codec.payload_from_proto(c.pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    np.testing.assert_array_equal(mw.tensors["w"], W * 2.0)
    agg.stop()


@pytest.mark.e2e
def test_killed_between_a_group_commit_and_its_acknowledgements(
        tmp_path: Path, raw_client: Callable[..., RawClient]) -> None:
    """Three updates written while another's fsync runs share the next fsync; the aggregator dies after that
    fsync, before any of the three is acknowledged. Nothing acknowledged is lost, the three are durable
    and the round's result is an uninterrupted run's."""
    orgs = ["a", "b", "c", "d"]
    agg = faults.AggregatorProcess(tmp_path, [run_config(organizations=orgs)], worker_threads=8)
    # Every fsync of the log waits 2 s first (a slow disk): b, c and d are written during a's.
    assert agg.start(crash_at="wal.synced:2", delay_at="wal.syncing:2") == ""
    clients = {o: raw_client(agg.port, o) for o in orgs}
    for cl in clients.values():
        cl.join(DECL)
    wal = agg.state_dir / "r" / "updates.wal"
    size = wal.stat().st_size
    results: dict[str, object] = {}

    def push(org: str, scale: float) -> None:
        try:
            results[org] = clients[org].push(1, upd(scale))
        except grpc.RpcError as err:
            results[org] = err.code()

    first = threading.Thread(target=push, args=("a", 1.0))
    first.start()
    wait_until(lambda: wal.stat().st_size > size, timeout=30, what="a's record written, its fsync under way")
    rest = [threading.Thread(target=push, args=(o, s)) for o, s in (("b", 2.0), ("c", 3.0), ("d", 6.0))]
    for t in rest:
        t.start()
    for t in [first, *rest]:
        t.join(timeout=90)
    wait_until(lambda: agg.exited() is not None, timeout=30, what="the crash")
    assert agg.exited() == EXIT_CODE
    acked = {o for o, r in results.items() if isinstance(r, apb.PushUpdateResponse) and r.accepted}
    assert acked == {"a"}, results  # a's own fsync came first; the group's acknowledgements never went out
    assert agg.start() == ""
    # All four records were durable: the restart replays them and closes round 1 from the log alone (the
    # group's retries find it closed, ``late``, which the client runtime passes over).
    status = clients["a"].stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs[0]
    assert status.round == 2 and status.history[0].clients == 4
    mw = codec.payload_from_proto(clients["a"].pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    np.testing.assert_array_equal(mw.tensors["w"], W * 3.0)  # the mean of 1, 2, 3 and 6
    agg.stop()


@pytest.mark.slow
def test_fault_campaign_quick(tmp_path: Path) -> None:
    """One run per kind of fault (a named point, random kills, a full disk, each damage, 500 fuzzed messages)."""
    out = tmp_path / "faults.json"
    code = faults.main(["--quick", "--workdir", str(tmp_path / "work"), "--json", str(out),
                        "--only", "kills,disk,corrupt,fuzz"])
    assert code == 0, out.read_text()
