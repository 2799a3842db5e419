"""FedMD end to end: `hetfed run` over real processes beats chance, every byte each way is logits on the public
subset, metrics or envelope, and the aggregator refuses what FedMD does not declare or another round's subset."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.algorithms.base import round_seed
from hetfed.cli.localrun import LocalRunOptions, aggregator_config
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind, SeedPosteriors
from hetfed.wire.specs.fedmd import public_subset
from hetfed.wire.traffic import embedded_size
from tests.conftest import RawClient, denied

pytestmark = pytest.mark.e2e
K, CLIENTS, ROUNDS = 10, 3, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``hetfed run --algorithm fedmd --dataset mnist5k`` as a user runs it (real processes, loopback gRPC)."""
    out = tmp_path_factory.mktemp("fedmd") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedmd", "--dataset", "mnist5k",
         "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (only,) = json.loads((out / "results.json").read_text())["runs"]
    return only  # type: ignore[no-any-return]


def _seed_set() -> dict[str, Any]:
    (run,) = aggregator_config(LocalRunOptions(algorithms=("fedmd",), clients=CLIENTS, rounds=2,
                                               partition="rotated"), "unused")["runs"]
    return run["seed_set"]  # type: ignore[no-any-return]


def _size(payload: Payload) -> int:
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def test_a_short_heterogeneous_run_beats_chance(run: dict[str, Any]) -> None:
    assert run["algorithm"] == "fedmd"
    assert [r["round"] for r in run["rounds"]] == [1, 2, 3, 4]  # three training rounds, then evaluate
    assert all(r["clients"] == CLIENTS for r in run["rounds"]), run["rounds"]  # every upload accepted
    assert run["final_test_accuracy"] > 0.5  # chance is 0.1
    final = run["rounds"][-1]["per_organization"]
    assert all(org["digest_loss"] > 0 for org in final.values())  # the evaluate round digested a consensus


def test_every_byte_is_public_logits_metrics_or_envelope(run: dict[str, Any]) -> None:
    # The run's public subset is its whole seed set (smaller than the default 5000): |S| × K float32 logits.
    size = _seed_set()["size"]
    logits = _size(SeedPosteriors("x" * len(_seed_set()["id"]), np.arange(size, dtype=np.int64),
                                  np.ones((size, K), np.float32), 0.0))
    for r in run["rounds"]:
        up, down = r["bytes_up"], r["bytes_down"]
        if r["round"] <= ROUNDS:
            assert set(up) == {"seed_posteriors", "eval_metrics", "envelope"}
            assert up["seed_posteriors"] == CLIENTS * logits
        else:
            assert set(up) == {"eval_metrics", "envelope"}
        # Round 1 has no consensus yet; every later instruction carries the last round's once.
        if r["round"] == 1:
            assert set(down) == {"envelope"}
        else:
            assert set(down) == {"seed_posteriors", "envelope"}
            assert down["seed_posteriors"] == CLIENTS * logits


def test_the_aggregator_refuses_what_fedmd_does_not_declare(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    seed_set = _seed_set()
    run = {"id": "r", "algorithm": "fedmd", "organizations": ["a", "b"], "rounds": 1, "seed": 3,
           "seed_set": {**seed_set, "parts": {}}, "algorithm_config": {"public_subset": 16}}
    agg = aggregator(run)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for c in (a, b):
        req = apb.JoinRequest(run_id="r", organization_id=c.organization)
        req.seed_set.id, req.seed_set.sha256 = seed_set["id"], seed_set["sha256"]
        c.stub.Join(req, metadata=c.metadata, timeout=10)
    ins = a.pull()
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1 and not ins.payloads
    s1 = public_subset(round_seed(3, 1), seed_set["size"], 16)
    logits = SeedPosteriors(seed_set["id"], s1, np.zeros((16, K), np.float32), 0.0)
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    weights = ModelWeights({"encoder.weight": np.zeros((4, 4), np.float32)}, 20)
    msg = denied(lambda: a.push(1, [logits, weights, metrics]))  # weights never cross the wire
    assert "payload_kind_not_allowed" in msg and PayloadKind.MODEL_WEIGHTS.value in msg
    with pytest.raises(grpc.RpcError) as err:  # an update without logits is incomplete
        a.push(1, [metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seed_posteriors" in str(err.value.details())
    other = SeedPosteriors(seed_set["id"], public_subset(round_seed(3, 2), seed_set["size"], 16),
                           np.zeros((16, K), np.float32), 0.0)
    with pytest.raises(grpc.RpcError) as err:  # another round's subset: no consensus with the others
        a.push(1, [other, metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "public subset" in str(err.value.details())
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 1
    # The round is unharmed: the valid updates are accepted and round 2 carries the consensus.
    assert a.push(1, [logits, metrics]).accepted
    assert b.push(1, [SeedPosteriors(seed_set["id"], s1, np.ones((16, K), np.float32), 0.0), metrics]).accepted
    ins = a.pull(completed=1)
    assert {codec.payload_kind_of(p) for p in ins.payloads} == {PayloadKind.SEED_POSTERIORS}
