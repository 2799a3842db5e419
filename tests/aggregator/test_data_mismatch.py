"""Organizations of one run share a label count and an input shape: the first to declare them at Join fixes them,
one that declares others is refused (``data_mismatch``) with both sides named, counted, and its client exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.run.state import DataShape
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import AggregatorClient, RemoteError
from tests.conftest import RawClient, run_config

W = np.array([1.0, 2.0, 3.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]
MNIST = (10, (1, 28, 28))
LAB_C = (5, (3, 64, 64))
REFUSED_C = ("data_mismatch: organization 'c' has 5 classes and inputs (3, 64, 64); run 'r' has 10 classes and "
             "inputs (1, 28, 28) from 'a'")


def join(c: RawClient, data: tuple[int, tuple[int, ...]] | None, declared: bool = True) -> apb.JoinResponse:
    """Join as ``c`` declaring ``data`` (label count, input shape; None: an older client that declares neither)."""
    req = apb.JoinRequest(run_id=c.run, organization_id=c.organization)
    if data is not None:
        req.num_classes, req.input_shape[:] = data[0], data[1]
    for kind, name, arr in DECL if declared else []:
        req.declared_tensors.add(payload_kind=kind.proto_enum, name=name, dtype=tpb.DTYPE_FLOAT32, shape=arr.shape)
    return c.stub.Join(req, metadata=c.metadata, timeout=10)


def sample(agg: Any, name: str, **labels: str) -> float:
    return agg.service.metrics.registry.get_sample_value(name, {"run": "r", **labels}) or 0.0


def update() -> list[Any]:
    return [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)]


def test_other_data_is_refused_at_join_counted_and_the_same_data_joins(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(organizations=["a", "b", "c"], rounds=2, round_deadline_seconds=900))
    a, b, c = (raw_client(agg.port, o) for o in "abc")
    join(a, MNIST)
    with pytest.raises(grpc.RpcError) as err:
        join(c, LAB_C)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == REFUSED_C
    assert sample(agg, "hetfed_rejected_messages_total", reason="data_mismatch") == 1.0
    assert sample(agg, "hetfed_refused_organizations", organization="c", reason="data_mismatch") == 1.0
    run = agg.service.runs["r"]
    assert set(run.refused) == {"c"} and run.joined == {"a"}
    # The refusal is the same every time (its tensors matter not), and the organization that fixed the data
    # cannot change it either.
    with pytest.raises(grpc.RpcError, match="data_mismatch: organization 'c' has 5 classes"):
        join(c, LAB_C, declared=False)
    with pytest.raises(grpc.RpcError) as err:
        join(a, LAB_C)
    assert err.value.details() == REFUSED_C.replace("'c'", "'a'")
    assert sample(agg, "hetfed_rejected_messages_total", reason="data_mismatch") == 3.0
    # The same data joins: a again, c with the run's data (its refusal lifted), b as an older client.
    join(a, MNIST)
    join(c, MNIST)
    join(b, None)
    assert run.joined == {"a", "b", "c"} and run.refused == {}
    assert sample(agg, "hetfed_refused_organizations", organization="c", reason="data_mismatch") == 0.0
    for cl in (a, b, c):
        assert cl.push(1, update()).accepted
    assert a.pull(completed=1).envelope.round == 2


def test_the_typed_client_reads_a_permanent_refusal(aggregator: Callable[..., Any],
                                                    raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(organizations=["a", "c"]))
    join(raw_client(agg.port, "a"), MNIST)
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "c", "r") as client, pytest.raises(RemoteError) as err:
        client.join(num_classes=5, input_shape=(3, 64, 64))
    e = err.value
    assert (e.code, e.reason, e.retryable) == (grpc.StatusCode.FAILED_PRECONDITION, "data_mismatch", False)
    assert REFUSED_C.split(": ", 1)[1] in str(e)
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "c", "r") as client:
        assert client.join(num_classes=10, input_shape=(1, 28, 28)).algorithm == "fedavg"


@pytest.mark.parametrize(("data", "says"), [
    ((-1, (1, 28, 28)), "num_classes must be >= 0 (0: not declared), got -1"),
    ((10, (1, 0, 28)), "input_shape must be at most 8 positive sizes (empty: not declared), got [1, 0, 28]"),
    ((10, (1,) * 9), "input_shape must be at most 8 positive sizes (empty: not declared), got [1, 1, 1, 1, 1"),
])
def test_an_impossible_declaration_is_invalid_and_fixes_nothing(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], data: tuple[int, tuple[int, ...]],
        says: str) -> None:
    agg = aggregator(run_config())
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    with pytest.raises(grpc.RpcError) as err:
        join(a, data)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"invalid_value: {says}")
    assert sample(agg, "hetfed_rejected_messages_total", reason="invalid_value") == 1.0
    join(b, MNIST)
    join(a, MNIST)
    assert agg.service.runs["r"].state.data_from == "b"


def test_a_client_with_other_data_exits_2_with_one_line(aggregator: Callable[..., Any],
                                                        raw_client: Callable[..., RawClient], tmp_path: Path) -> None:
    """The runtime declares its data's label count and input shape: digits' 8×8 images after MNIST's 28×28."""
    agg = aggregator(run_config(organizations=["a", "b"]))
    join(raw_client(agg.port, "a"), MNIST)
    cfg = {"organization": "b", "run": "r", "aggregator": f"127.0.0.1:{agg.port}", "threads": 1, "device": "cpu",
           "data": {"dataset": "digits", "partition": "iid", "num_clients": 2, "client_index": 1},
           "model": {"name": "mlp"}, "retry": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.5}}
    (tmp_path / "b.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "client", "--config", str(tmp_path / "b.json")],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr
    refusal = [line for line in proc.stderr.splitlines() if line.startswith("hetfed client:")]
    assert len(refusal) == 1 and "refused 'b' for good (data_mismatch)" in refusal[0]
    assert ("organization 'b' has 10 classes and inputs (1, 8, 8); run 'r' has 10 classes and inputs (1, 28, 28) "
            "from 'a'") in refusal[0]


def test_an_algorithm_that_keeps_heads_local_fixes_the_input_shape_only(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """SimFed's and FedAvg-of-the-body's organizations may count classes differently; ``local`` shares nothing."""
    agg = aggregator(run_config(id="s", algorithm="simfed", organizations=["a", "b", "c"]),
                     run_config(id="l", algorithm="local", organizations=["a", "b"]))
    a, b, c = (raw_client(agg.port, o, run="s") for o in "abc")
    join(a, MNIST, declared=False)
    join(b, (5, (1, 28, 28)), declared=False)
    with pytest.raises(grpc.RpcError) as err:
        join(c, LAB_C, declared=False)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("data_mismatch: organization 'c' has inputs (3, 64, 64); run 's' has inputs "
                                   "(1, 28, 28) from 'a'")
    la, lb = (raw_client(agg.port, o, run="l") for o in "ab")
    join(la, MNIST, declared=False)
    join(lb, LAB_C, declared=False)
    assert agg.service.runs["l"].state.data == DataShape()
