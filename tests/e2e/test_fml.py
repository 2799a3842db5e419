"""FML end to end: `hetfed run` over real processes with three private architectures and one shared meme model
beats chance with both models; every model byte each way is the meme model's, never a private model's; the
aggregator refuses what FML does not declare."""

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

from hetfed.client.algorithms.fedavg import shared_state
from hetfed.client.algorithms.fml import build_meme
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.models import build_model
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Payload, PayloadKind
from hetfed.wire.specs import get_spec
from hetfed.wire.traffic import embedded_size
from tests.conftest import RawClient, denied

pytestmark = pytest.mark.e2e
K, CLIENTS, ROUNDS, SEED = 10, 3, 3, 0
MODELS = ("lenet", "mlp", "fedgen_cnn")  # the private models; the meme model is the config's default, mlp
SHAPE = (1, 28, 28)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``hetfed run --algorithm fml --dataset mnist5k --models lenet,mlp,fedgen_cnn`` as a user runs it."""
    where = tmp_path_factory.mktemp("fml") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fml", "--dataset", "mnist5k", "--clients",
         str(CLIENTS), "--rounds", str(ROUNDS), "--models", ",".join(MODELS), "--seed", str(SEED),
         "--output", str(where)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return where


@pytest.fixture(scope="module")
def run(out: Path) -> dict[str, Any]:
    (only,) = json.loads((out / "results.json").read_text())["runs"]
    return only  # type: ignore[no-any-return]


def _size(payload: Payload) -> int:
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def _meme(examples: int = 0) -> ModelWeights:
    """The meme model's ModelWeights as the wire carries it (the run seed's initial weights: sizes only)."""
    meme = build_meme(get_spec("fml").config(), SHAPE, K, SEED)
    return ModelWeights({k: v.numpy() for k, v in shared_state(meme).items()}, examples)


def test_three_architectures_and_one_meme_model_beat_chance(run: dict[str, Any], out: Path) -> None:
    assert run["algorithm"] == "fml"
    assert [r["round"] for r in run["rounds"]] == [1, 2, 3, 4]  # three training rounds, then evaluate
    assert all(r["clients"] == CLIENTS for r in run["rounds"]), run["rounds"]  # every upload accepted
    assert run["final_test_accuracy"] > 0.5  # the private models; chance is 0.1
    # The averaged meme model, scored by every organization: chance at round 1 (initial weights), far above at the end.
    first, final = run["rounds"][0]["per_organization"], run["rounds"][-1]["per_organization"]
    assert np.mean([o["meme_model_test_accuracy"] for o in first.values()]) < 0.25
    assert run["final_figures"]["meme"] > 0.3
    assert all(o["meme_model_test_accuracy"] > 0.2 for o in final.values())
    # Each organization trained and deploys its own architecture.
    cards = [json.loads((out / "artifacts" / "fml" / f"org-{i}" / "model" / "card.json").read_text())
             for i in range(CLIENTS)]
    assert [c["architecture"] for c in cards] == list(MODELS)


def test_every_model_byte_is_the_meme_models(run: dict[str, Any], out: Path) -> None:
    down = _size(_meme())
    # Up: the meme model with each organization's example count; never a private model (lenet's and fedgen_cnn's
    # differ in size from the meme model, mlp).
    examples = [len(load_client_data(DataConfig(**json.loads((out / f"client-fml-org-{i}.json").read_text())["data"]))
                    .train) for i in range(CLIENTS)]
    up = sum(_size(_meme(n)) for n in examples)
    for private in ("lenet", "fedgen_cnn"):
        model = build_model(private, SHAPE, K)
        assert sum(v.numel() for v in shared_state(model).values()) != sum(a.size for a in _meme().tensors.values())
    for r in run["rounds"]:
        bytes_up, bytes_down = r["bytes_up"], r["bytes_down"]
        if r["round"] <= ROUNDS:
            assert set(bytes_up) == {"model_weights", "eval_metrics", "envelope"}
            assert bytes_up["model_weights"] == up
        else:
            assert set(bytes_up) == {"eval_metrics", "envelope"}
        # Round 1 starts from the run seed; every later instruction carries the averaged meme model once.
        if r["round"] == 1:
            assert set(bytes_down) == {"envelope"}
        else:
            assert set(bytes_down) == {"model_weights", "envelope"}
            assert bytes_down["model_weights"] == CLIENTS * down


def test_the_aggregator_refuses_what_fml_does_not_declare(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    run = {"id": "r", "algorithm": "fml", "organizations": ["a", "b"], "rounds": 1, "seed": 3}
    agg = aggregator(run)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    meme = {"head.weight": np.zeros((K, 4), np.float32), "head.bias": np.zeros(K, np.float32)}
    declared = [(PayloadKind.MODEL_WEIGHTS, name, value) for name, value in meme.items()]
    a.join(declared, examples=20)
    b.join(declared, examples=10)
    ins = a.pull()
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1 and not ins.payloads
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    head = HeadWeights(np.zeros((K, 4), np.float32), np.zeros(K, np.float32))
    msg = denied(lambda: a.push(1, [ModelWeights(meme, 20), head, metrics]))  # a head alone is never FML's
    assert "payload_kind_not_allowed" in msg and PayloadKind.HEAD_WEIGHTS.value in msg
    private = {**meme, "encoder.conv1.weight": np.zeros((6, 1, 5, 5), np.float32)}  # a private model's tensor
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, [ModelWeights(private, 20), metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unexpected tensors ['encoder.conv1.weight']" in str(err.value.details())
    with pytest.raises(grpc.RpcError) as err:  # an update without the meme model is incomplete
        a.push(1, [metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_weights" in str(err.value.details())
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 1
    # The round is unharmed: the valid updates are accepted and round 2 carries their average, weighted 20 : 10.
    ones = {k: np.ones_like(v) for k, v in meme.items()}
    assert a.push(1, [ModelWeights(ones, 20), metrics]).accepted
    assert b.push(1, [ModelWeights({k: 4 * v for k, v in ones.items()}, 10), metrics]).accepted
    ins = a.pull(completed=1)
    (payload,) = ins.payloads
    got = codec.payload_from_proto(payload)
    assert isinstance(got, ModelWeights)
    np.testing.assert_array_equal(got.tensors["head.bias"], np.full(K, 2.0, np.float32))  # (20·1 + 10·4) / 30


def test_a_run_under_privacy_is_refused_by_every_client_before_it_trains(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fml", "--dataset", "digits", "--clients", "2",
         "--rounds", "1", "--set", "privacy.noise_multiplier=1.0", "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "[privacy] is set, but hetfed has no DP mechanism for fml's uploads" in proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()
