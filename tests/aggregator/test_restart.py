"""Durability: an aggregator process killed between pushes resumes the open round with every acknowledged update."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from tests.conftest import RawClient, aggregator_processes

W = np.array([2.0, 4.0, 8.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]


def upd(scale: float, n: int) -> list[Any]:
    return [ModelWeights({"w": W * scale}, n), EvalMetrics(test_accuracy=0.5, num_test_examples=1)]


@pytest.fixture
def aggregator_process(tmp_path: Path) -> Iterator[Callable[[], tuple[Any, int]]]:
    """Start (and restart) a real ``hetfed aggregator`` process on one port and one state directory."""
    yield from aggregator_processes(tmp_path, {"id": "r", "algorithm": "fedavg", "organizations": ["a", "b", "c"], "rounds": 2})


def test_kill_between_pushes_then_resume(aggregator_process: Callable[[], tuple[Any, int]],
                                         raw_client: Callable[..., RawClient]) -> None:
    proc, port = aggregator_process()
    a, b, c = (raw_client(port, o) for o in "abc")
    for cl in (a, b, c):
        cl.join(DECL)
    # Round 1 completes; round 2 gets two acknowledged pushes, then the process dies without warning.
    for cl, s in ((a, 1.0), (b, 1.0), (c, 1.0)):
        cl.push(1, upd(s, 1))
    assert a.push(2, upd(1.0, 1)).accepted
    assert b.push(2, upd(2.0, 2)).accepted
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    aggregator_process()
    # c's client reconnects and is told round 2 is open; a's retry of its acknowledged push is a duplicate.
    ins = c.pull(completed=1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    assert a.push(2, upd(1.0, 1)).duplicate
    c.push(2, upd(7.0, 1))
    ins = c.pull(completed=2)
    assert ins.action == apb.ACTION_EVALUATE
    mw = codec.payload_from_proto(ins.payloads[0])
    assert isinstance(mw, ModelWeights)
    # (1·1 + 2·2 + 7·1) / (1 + 2 + 1) = 3 → 3·W: nothing acknowledged before the kill was lost.
    np.testing.assert_array_equal(mw.tensors["w"], W * 3.0)
    for cl in (a, b, c):
        cl.push(3, [EvalMetrics(test_accuracy=1.0)])
    assert a.pull(completed=3).action == apb.ACTION_FINISH
    status = a.stub.Status(apb.StatusRequest(run_id="r"), timeout=5).runs[0]
    assert [h.round for h in status.history] == [1, 2, 3]


def test_the_runs_label_count_and_input_shape_survive_a_kill(aggregator_process: Callable[[], tuple[Any, int]],
                                                            raw_client: Callable[..., RawClient]) -> None:
    """The first organization's declared data is written with its Join: after a kill it still decides."""

    def join(cl: RawClient, num_classes: int, input_shape: tuple[int, ...]) -> apb.JoinResponse:
        req = apb.JoinRequest(run_id="r", organization_id=cl.organization, num_classes=num_classes,
                              input_shape=input_shape)
        return cl.stub.Join(req, metadata=cl.metadata, timeout=10)

    proc, port = aggregator_process()
    join(raw_client(port, "a"), 10, (1, 28, 28))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    _, port = aggregator_process()
    b, c = raw_client(port, "b"), raw_client(port, "c")
    with pytest.raises(grpc.RpcError) as err:
        join(c, 5, (3, 64, 64))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("data_mismatch: organization 'c' has 5 classes and inputs (3, 64, 64); run 'r' "
                                   "has 10 classes and inputs (1, 28, 28) from 'a'")
    join(b, 10, (1, 28, 28))  # the same data joins
