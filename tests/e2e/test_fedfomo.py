"""FedFomo end to end: `hetfed run` over real processes beats chance, every byte each way is a relayed model, the
peer weights, metrics or envelope, in the amounts the spec implies; and the aggregator relays the very model a
peer sent and refuses what FedFomo does not declare or weights that do not name what was sent."""

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
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Payload, PayloadKind, PeerWeights
from hetfed.wire.traffic import embedded_size
from tests.conftest import RawClient, denied

pytestmark = pytest.mark.e2e
CLIENTS, ROUNDS = 3, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``hetfed run --algorithm fedfomo`` as a user runs it (real processes, loopback gRPC), one local epoch."""
    out = tmp_path_factory.mktemp("fedfomo") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedfomo", "--dataset", "mnist5k",
         "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--models", "mlp", "--set", "fedfomo.local_epochs=1",
         "--output", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (only,) = json.loads((out / "results.json").read_text())["runs"]
    return only  # type: ignore[no-any-return]


def _size(payload: Payload) -> int:
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def test_a_short_run_beats_chance_and_weighs_models_from_round_two(run: dict[str, Any]) -> None:
    assert run["algorithm"] == "fedfomo"
    assert [r["round"] for r in run["rounds"]] == [1, 2, 3]  # two training rounds, then evaluate
    assert all(r["clients"] == CLIENTS for r in run["rounds"]), run["rounds"]  # every upload accepted
    assert run["final_test_accuracy"] > 0.3  # chance is 0.1
    first, *later = run["rounds"]
    assert all("fomo_helpful_models" not in org for org in first["per_organization"].values())
    for r in later:  # each organization weighed its own model and its 2 peers', and kept at most all 3
        assert all(0 <= org["fomo_helpful_models"] <= 3 for org in r["per_organization"].values())


def test_every_byte_is_a_relayed_model_peer_weights_metrics_or_envelope(run: dict[str, Any]) -> None:
    rounds = {r["round"]: r for r in run["rounds"]}
    names = tuple(f"org-{i}" for i in range(CLIENTS))
    # Up, each training round: every organization's model (its own example count in each).
    models_up = {r: rounds[r]["bytes_up"]["model_weights"] for r in (1, 2)}
    assert models_up[1] == models_up[2] > 0
    assert set(rounds[1]["bytes_up"]) == {"model_weights", "eval_metrics", "envelope"}
    assert set(rounds[1]["bytes_down"]) == {"envelope"}  # nothing to relay before round 1 closes
    # Round 2 up: each weighs itself and its CLIENTS − 1 peers (peers_per_round is 4): names of 5 characters.
    weights_up = CLIENTS * _size(PeerWeights(names, np.zeros(CLIENTS, np.float32)))
    assert rounds[2]["bytes_up"]["peer_weights"] == weights_up
    assert set(rounds[2]["bytes_up"]) == {"model_weights", "peer_weights", "eval_metrics", "envelope"}
    assert set(rounds[3]["bytes_up"]) == {"eval_metrics", "envelope"}
    # Down, rounds 2 and 3: every organization receives every other's model of the round before, whole, and
    # one PeerWeights naming them: (CLIENTS − 1) × what went up.
    names_down = CLIENTS * _size(PeerWeights(names[:2], np.zeros(2, np.float32)))
    for r in (2, 3):
        assert rounds[r]["bytes_down"]["model_weights"] == (CLIENTS - 1) * models_up[r - 1]
        assert rounds[r]["bytes_down"]["peer_weights"] == names_down
        assert set(rounds[r]["bytes_down"]) == {"model_weights", "peer_weights", "envelope"}


def test_the_aggregator_relays_what_a_peer_sent_and_refuses_what_fedfomo_does_not_declare(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    run = {"id": "r", "algorithm": "fedfomo", "organizations": ["a", "b", "c"], "rounds": 2, "seed": 3,
           "algorithm_config": {"peers_per_round": 1}}
    agg = aggregator(run)
    clients = {o: raw_client(agg.port, o) for o in ("a", "b", "c")}
    model = {o: ModelWeights({"w": np.array([i, -i, 0.5 * i], np.float32)}, 10 + i)
             for i, o in enumerate(clients)}
    for o, c in clients.items():
        c.join([(PayloadKind.MODEL_WEIGHTS, "w", np.zeros(3, np.float32))], examples=model[o].num_examples)
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    a = clients["a"]
    ins = a.pull()
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1 and not ins.payloads
    head = HeadWeights(np.zeros((2, 3), np.float32), np.zeros(2, np.float32))
    msg = denied(lambda: a.push(1, [model["a"], head, metrics]))
    assert "payload_kind_not_allowed" in msg and PayloadKind.HEAD_WEIGHTS.value in msg
    with pytest.raises(grpc.RpcError) as err:  # an update without the model is incomplete
        a.push(1, [metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_weights" in str(err.value.details())
    for o, c in clients.items():
        assert c.push(1, [model[o], metrics]).accepted
    ins = a.pull(completed=1)
    assert ins.envelope.round == 2
    names, relayed = (codec.payload_from_proto(p) for p in ins.payloads)
    assert isinstance(names, PeerWeights) and isinstance(relayed, ModelWeights)
    (peer,) = names.organizations
    assert peer in ("b", "c")
    assert relayed.tensors["w"].tobytes() == model[peer].tensors["w"].tobytes()  # the peer's model, unchanged
    assert relayed.num_examples == model[peer].num_examples
    other = "c" if peer == "b" else "b"
    for report, reason in ((None, "must report its peer_weights"),
                           (PeerWeights(("a", other), np.ones(2, np.float32)), "its peers in the order sent")):
        with pytest.raises(grpc.RpcError) as err:
            a.push(2, [model["a"], *([report] if report else []), metrics])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in str(err.value.details())
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 1
    # The round is unharmed: the report naming itself and the peer it was sent is accepted.
    assert a.push(2, [model["a"], PeerWeights(("a", peer), np.array([0.5, 1.5], np.float32)), metrics]).accepted
