"""FedProto end to end: `hetfed run` over real processes beats chance, every byte each way is a prototype
payload, metrics or envelope, and the aggregator refuses every kind FedProto does not declare."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    EvalMetrics,
    HeadWeights,
    ModelWeights,
    Payload,
    PayloadKind,
)
from hetfed.wire.traffic import embedded_size
from tests.conftest import RawClient, denied

pytestmark = pytest.mark.e2e
K, D = 4, 2  # gauss4: four classes; the run's defaults give it a 2-D prototype space
CLIENTS, ROUNDS = 3, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``hetfed run --algorithm fedproto --dataset gauss4`` as a user runs it (real processes, loopback gRPC)."""
    out = tmp_path_factory.mktemp("fedproto") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedproto", "--dataset", "gauss4",
         "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (only,) = json.loads((out / "results.json").read_text())["runs"]
    return only  # type: ignore[no-any-return]


def test_a_short_run_beats_chance_by_its_own_head_and_by_its_prototypes(run: dict[str, Any]) -> None:
    assert run["algorithm"] == "fedproto"
    assert [r["round"] for r in run["rounds"]] == [1, 2, 3, 4]  # three training rounds, then evaluate
    assert all(r["clients"] == CLIENTS for r in run["rounds"]), run["rounds"]  # every upload accepted
    assert run["final_test_accuracy"] > 0.5  # chance is 0.25
    for org in run["rounds"][-1]["per_organization"].values():
        assert org["prototype_test_accuracy"] > 0.5


def _size(payload: Payload) -> int:
    """Bytes a payload takes inside a message (what the traffic accounting attributes to its kind)."""
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def test_every_byte_is_prototypes_metrics_or_envelope(run: dict[str, Any]) -> None:
    prototypes = _size(ClassMeanEmbeddings(np.zeros(K, np.int64), np.zeros((K, D), np.float32),
                                           np.zeros(K, np.int64), np.zeros(K, bool)))
    for r in run["rounds"]:
        up, down = r["bytes_up"], r["bytes_down"]
        if r["round"] <= ROUNDS:
            assert set(up) == {"class_mean_embeddings", "eval_metrics", "envelope"}
            assert up["class_mean_embeddings"] == CLIENTS * prototypes
        else:
            assert set(up) == {"eval_metrics", "envelope"}
        # Round 1 has no global prototype yet; every later instruction carries them once.
        if r["round"] == 1:
            assert set(down) == {"envelope"}
        else:
            assert set(down) == {"class_mean_embeddings", "envelope"}
            assert down["class_mean_embeddings"] == CLIENTS * prototypes
    # One organization's prototypes (K = 4, d_e = 2) are an eighth of the MLP encoder's smallest tensor (2 × 200).
    assert prototypes < 2 * 200 * 4 / 8


# ---------------------------------------------------------------------------------------------- contract
def test_the_aggregator_refuses_what_fedproto_does_not_declare(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    run = {"id": "r", "algorithm": "fedproto", "organizations": ["a", "b"], "rounds": 1,
           "algorithm_config": {"latent_dim": D, "num_classes": K}}
    agg = aggregator(run)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join()
    b.join()
    ins = a.pull()
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1 and not ins.payloads  # no setup round
    counts = np.array([4, 0, 2, 1], np.int64)
    protos = ClassMeanEmbeddings(np.arange(K), np.full((K, D), 0.5, np.float32), counts, counts > 0)
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    weights = ModelWeights({"encoder.weight": np.zeros((D, 2), np.float32)}, 20)
    head = HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32), 20)
    # Model weights, a head or class counts, alone or beside a valid update, are refused by kind.
    for extra in (weights, head, ClassCounts(counts)):
        msg = denied(lambda extra=extra: a.push(1, [protos, extra, metrics]))
        assert "payload_kind_not_allowed" in msg and extra.kind.value in msg
    # An update without its prototypes is refused as incomplete.
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, [metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "class_mean_embeddings" in str(err.value.details())
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 3
    # The round is unharmed: the valid updates are accepted and round 2 carries the global prototypes.
    assert a.push(1, [protos, metrics]).accepted
    assert b.push(1, [protos, metrics]).accepted
    ins = a.pull(completed=1)
    assert {codec.payload_kind_of(p) for p in ins.payloads} == {PayloadKind.CLASS_MEAN_EMBEDDINGS}
