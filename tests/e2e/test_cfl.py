"""CFL end to end: `hetfed run` over real processes, with two groups of organizations that name the classes
differently (permuted labels, one permutation per group), ends in exactly those two clusters and beats FedAvg by
far; every byte each way is the initial model, an update, a cluster's model, metrics or envelope; and the
aggregator refuses what CFL does not declare and sends each organization its own cluster's model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Payload, PayloadKind
from hetfed.wire.traffic import embedded_size
from tests.conftest import RawClient, aggregator_processes, denied

pytestmark = pytest.mark.e2e
CLIENTS, ROUNDS = 4, 5
# Organizations k and k + 2 share one label map (data.label_groups = 2): the clusters CFL should find.
GROUPS = [["org-0", "org-2"], ["org-1", "org-3"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``hetfed run --algorithm cfl,fedavg`` on digits, iid, labels permuted in two groups; CFL may split from
    round 2 on (ε1 and ε2 out of the way: the criterion is tested at its thresholds in the unit tests)."""
    out = tmp_path_factory.mktemp("cfl") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "cfl,fedavg", "--dataset", "digits",
         "--model", "mlp", "--partition", "iid", "--clients", str(CLIENTS), "--rounds", str(ROUNDS),
         "--data", "permute_labels=true", "--data", "label_groups=2",
         "--set", "batch_size=32", "--set", "local_epochs=2", "--set", "lr=0.05",
         "--set", "cfl.split_from_round=2", "--set", "cfl.eps1=1e9", "--set", "cfl.eps2=0",
         "--output", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["algorithm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    return {"runs": runs, "out": out}


def _clusters(out: Path) -> list[list[str]]:
    """The organizations of each cluster, from the aggregator's checkpoint of the finished run."""
    with np.load(out / "state" / "cfl" / "checkpoint.npz") as z:
        of = {k[len("a/cluster."):]: int(z[k]) for k in z.files if k.startswith("a/cluster.")}
    return [sorted(o for o, c in of.items() if c == k) for k in sorted(set(of.values()))]


def _model_bytes(num_examples: int) -> int:
    """The ModelWeights payload of the run's model (mlp on 8x8 digits, ten classes), as counted on the wire."""
    from hetfed.client.algorithms.fedavg import shared_state
    from hetfed.client.models import build_model

    model = build_model("mlp", (1, 8, 8), 10, seed=0, latent_dim=None, bounded_latent=False)
    tensors = {k: v.numpy() for k, v in shared_state(model).items()}
    return _size(ModelWeights(tensors, num_examples))


def _size(payload: Payload) -> int:
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def test_two_groups_with_different_label_maps_end_in_two_clusters_and_beat_fedavg(run: dict[str, Any]) -> None:
    cfl, fedavg = run["runs"]["cfl"], run["runs"]["fedavg"]
    assert [r["round"] for r in cfl["rounds"]] == [0, *range(1, ROUNDS + 2)]  # setup, training, evaluate
    assert all(r["clients"] == CLIENTS for r in cfl["rounds"]), cfl["rounds"]  # every upload accepted
    assert _clusters(run["out"]) == GROUPS
    # One model cannot serve two label maps; one per cluster can (measured: 0.94 against 0.52).
    assert cfl["final_test_accuracy"] > 0.85
    assert cfl["final_test_accuracy"] > fedavg["final_test_accuracy"] + 0.25


def test_every_byte_is_a_model_an_update_metrics_or_envelope(run: dict[str, Any]) -> None:
    cfl = run["runs"]["cfl"]
    for r in cfl["rounds"]:
        up, down = r["bytes_up"], r["bytes_down"]
        if r["round"] == 0:  # setup: each organization's initial model, nothing down
            assert set(up) == {"model_weights", "envelope"} and set(down) == {"envelope"}
        elif r["round"] <= ROUNDS:  # an update up, the cluster's model down, per organization
            assert set(up) == {"model_weights", "eval_metrics", "envelope"}
            assert set(down) == {"model_weights", "envelope"}
        else:  # evaluate: the cluster's final model down, metrics up
            assert set(up) == {"eval_metrics", "envelope"} and set(down) == {"model_weights", "envelope"}
        if "model_weights" in down:
            assert down["model_weights"] == CLIENTS * _model_bytes(0)
    # Each upload carries one model's tensors and an example count (digits iid: 359 or 360 examples each, a
    # varint of two bytes either way).
    for r in cfl["rounds"][:ROUNDS + 1]:
        assert r["bytes_up"]["model_weights"] == CLIENTS * _model_bytes(359)


def test_the_aggregator_refuses_what_cfl_does_not_declare_and_sends_each_cluster_its_model(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    config = {"split_from_round": 1, "eps1": 1e9, "eps2": 0.0, "min_split_size": 2}
    agg = aggregator({"id": "r", "algorithm": "cfl", "organizations": ["a", "b"], "rounds": 2, "seed": 3,
                      "algorithm_config": config})
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    theta0 = np.array([0.5, -1.0, 2.0], np.float32)
    for c in (a, b):
        c.join([(PayloadKind.MODEL_WEIGHTS, "w", theta0)], examples=10)
    ins = a.pull()
    assert ins.action == apb.ACTION_SETUP and not ins.payloads
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    initial = ModelWeights({"w": theta0}, 10)
    msg = denied(lambda: a.push(0, [initial, metrics]))  # the setup sends the initial model only
    assert "payload_kind_not_allowed" in msg and PayloadKind.EVAL_METRICS.value in msg
    for c in (a, b):
        assert c.push(0, [initial]).accepted
    ins = a.pull(completed=0)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1
    (sent,) = (codec.payload_from_proto(p) for p in ins.payloads)
    assert isinstance(sent, ModelWeights) and sent.tensors["w"].tolist() == theta0.tolist()
    head = HeadWeights(np.zeros((2, 3), np.float32), np.zeros(2, np.float32), 10)
    msg = denied(lambda: a.push(1, [ModelWeights({"w": np.ones(3, np.float32)}, 10), metrics, head]))
    assert "payload_kind_not_allowed" in msg and PayloadKind.HEAD_WEIGHTS.value in msg
    with pytest.raises(grpc.RpcError) as err:  # an update needs an example count
        a.push(1, [ModelWeights({"w": np.ones(3, np.float32)}, 0), metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_examples" in str(err.value.details())
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 2
    # Opposite updates: the pair splits, and round 2 sends each organization its own cluster's model.
    assert a.push(1, [ModelWeights({"w": np.array([1.0, 0.0, 0.0], np.float32)}, 10), metrics]).accepted
    assert b.push(1, [ModelWeights({"w": np.array([-1.0, 0.0, 0.5], np.float32)}, 10), metrics]).accepted
    got = {}
    for c in (a, b):
        ins = c.pull(completed=1)
        assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
        (mw,) = (codec.payload_from_proto(p) for p in ins.payloads)
        got[c.organization] = mw.tensors["w"].tolist()
    assert got == {"a": [1.5, -1.0, 2.0], "b": [-0.5, -1.0, 2.5]}


def test_a_run_under_privacy_is_refused_at_join() -> None:
    """CFL has no DP mechanism: its client refuses [privacy] once it has joined, before any upload."""
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "cfl", "--rounds", "1", "--clients", "2",
         "--dataset", "digits", "--model", "mlp", "--set", "privacy.epsilon_budget=3", "--no-report"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0
    assert "[privacy] is set, but hetfed has no DP mechanism for cfl's uploads" in proc.stdout + proc.stderr


@pytest.fixture
def aggregator_process(tmp_path: Path) -> Iterator[Callable[[], tuple[Any, int]]]:
    """Start (and restart) a real ``hetfed aggregator`` process on one port and one state directory."""
    run = {"id": "r", "algorithm": "cfl", "organizations": ["a", "b", "c"], "rounds": 3,
           "algorithm_config": {"split_from_round": 1, "eps1": 1e9, "eps2": 0.0}}
    yield from aggregator_processes(tmp_path, run)


def _pull_model(c: RawClient, completed: int, round_: int) -> list[float]:
    ins = c.pull(completed=completed)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == round_
    (mw,) = (codec.payload_from_proto(p) for p in ins.payloads)
    assert isinstance(mw, ModelWeights)
    return mw.tensors["w"].tolist()  # type: ignore[no-any-return]


def test_the_clusters_and_their_models_survive_a_killed_aggregator(
    aggregator_process: Callable[[], tuple[Any, int]], raw_client: Callable[..., RawClient]
) -> None:
    proc, port = aggregator_process()
    a, b, c = (raw_client(port, o) for o in "abc")
    theta0 = np.array([0.5, -1.0, 2.0], np.float32)
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    for cl in (a, b, c):
        cl.join([(PayloadKind.MODEL_WEIGHTS, "w", theta0)], examples=10)
    for cl in (a, b, c):
        assert cl.push(0, [ModelWeights({"w": theta0}, 10)]).accepted

    def update(*w: float) -> list[Any]:
        return [ModelWeights({"w": np.array(w, np.float32)}, 10), metrics]

    # Round 1: a and b move alike, c against them: the three split into {a, b} and {c}.
    for cl, w in ((a, (1.0, 0.0, 0.0)), (b, (0.75, 0.25, 0.0)), (c, (-1.0, 0.0, 0.5))):
        assert cl.push(1, update(*w)).accepted
    assert _pull_model(a, 1, 2) == _pull_model(b, 1, 2) == [1.375, -0.875, 2.0]  # θ0 + (0.875, 0.125, 0)
    assert _pull_model(c, 1, 2) == [-0.5, -1.0, 2.5]
    # Round 2: a's update is acknowledged, then the process dies without warning.
    assert a.push(2, update(0.5, 0.0, 0.0)).accepted
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    aggregator_process()
    # The restarted aggregator sends each organization its own cluster's model again ...
    assert _pull_model(b, 1, 2) == [1.375, -0.875, 2.0]
    assert _pull_model(c, 1, 2) == [-0.5, -1.0, 2.5]
    assert a.push(2, update(0.5, 0.0, 0.0)).duplicate
    assert b.push(2, update(0.25, 0.25, 0.0)).accepted
    assert c.push(2, update(0.0, 1.0, 0.0)).accepted
    # ... and closes round 2 with a's acknowledged update: {a, b} (too small to split again) moves by their mean.
    assert _pull_model(a, 2, 3) == _pull_model(b, 2, 3) == [1.75, -0.75, 2.0]
    assert _pull_model(c, 2, 3) == [-0.5, 0.0, 2.5]
