"""FedGen end to end: `hetfed run` over real processes beats chance; every byte each way is the declared
encoder, head, label counts, generator, metrics or envelope, sized as the spec implies; sharing the head alone
(`fedgen_head`, two architectures) sends no encoder tensor; and the aggregator refuses what FedGen does not
declare, then closes the round with the valid updates and sends the generator down."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.client.algorithms import client_half_type
from hetfed.client.algorithms.fedavg import shared_state
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import (
    ClassCounts,
    EvalMetrics,
    HeadWeights,
    ModelWeights,
    Payload,
    PayloadKind,
    SeedPosteriors,
)
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedgen import GENERATOR_PREFIX, GENERATOR_TENSORS
from hetfed.wire.traffic import embedded_size
from tests.conftest import RawClient, denied

pytestmark = pytest.mark.e2e
K, D, CLIENTS, ROUNDS = 10, 32, 3, 3
SPEC = get_spec("fedgen")


def _run(tmp_path_factory: pytest.TempPathFactory, algorithm: str) -> dict[str, Any]:
    """``hetfed run --algorithm ALGORITHM --dataset mnist5k`` as a user runs it (real processes, loopback gRPC)."""
    out = tmp_path_factory.mktemp(algorithm) / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", algorithm, "--dataset", "mnist5k",
         "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--output", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (only,) = json.loads((out / "results.json").read_text())["runs"]
    return only  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory, "fedgen")


@pytest.fixture(scope="module")
def head_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory, "fedgen_head")


def _size(payload: Payload) -> int:
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def _body() -> dict[str, np.ndarray]:
    """The encoder tensors of the run's model (the reference code's MNIST CNN, latent 32), as float32 zeros."""
    model = client_half_type(SPEC).make_model("fedgen_cnn", (1, 28, 28), K, seed=0, latent_dim=D,
                                              bounded_latent=False, config=SPEC.config())
    return {n: np.zeros(tuple(v.shape), np.float32) for n, v in shared_state(model).items()
            if not n.startswith("head.")}


def _generator() -> dict[str, np.ndarray]:
    cfg = SPEC.config()
    shapes = {"fc.weight": (cfg.hidden_dim, cfg.noise_dim + K), "fc.bias": (cfg.hidden_dim,),
              "out.weight": (D, cfg.hidden_dim), "out.bias": (D,)}
    return {GENERATOR_PREFIX + n: np.zeros(shapes.get(n, (cfg.hidden_dim,)), np.float32) for n in GENERATOR_TENSORS}


def test_a_short_run_beats_chance(run: dict[str, Any]) -> None:
    assert run["algorithm"] == "fedgen"
    assert [r["round"] for r in run["rounds"]] == [1, 2, 3, 4]  # three training rounds, then evaluate
    assert all(r["clients"] == CLIENTS for r in run["rounds"]), run["rounds"]  # every upload accepted
    assert run["final_test_accuracy"] > 0.5  # chance is 0.1


def test_every_byte_is_declared_and_sized_as_the_spec_implies(run: dict[str, Any]) -> None:
    body = _body()
    # Each organization holds 1,000-2,000 of mnist5k's 5,000 examples: a two-byte example count.
    up = {"model_weights": _size(ModelWeights(body, 1000)),
          "head_weights": _size(HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32), 1000)),
          "class_counts": _size(ClassCounts(np.zeros(K, np.int64)))}
    down = {"model_weights": _size(ModelWeights(body | _generator())),
            "head_weights": _size(HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32)))}
    generator_bytes = sum(a.nbytes for a in _generator().values())
    assert generator_bytes == 4 * (256 * (32 + K) + 256 + 2 * 256 + 2 * 256 + D * 256 + D)  # 81,024 bytes
    for r in run["rounds"]:
        if r["round"] <= ROUNDS:
            assert set(r["bytes_up"]) == {*up, "eval_metrics", "envelope"}
            assert all(r["bytes_up"][kind] == CLIENTS * size for kind, size in up.items()), r["bytes_up"]
        else:
            assert set(r["bytes_up"]) == {"eval_metrics", "envelope"}
        if r["round"] == 1:  # nothing to send before the first close
            assert set(r["bytes_down"]) == {"envelope"}
        else:  # the averaged encoder with the generator beside it, and the averaged head
            assert set(r["bytes_down"]) == {*down, "envelope"}
            assert all(r["bytes_down"][kind] == CLIENTS * size for kind, size in down.items()), r["bytes_down"]


def test_sharing_the_head_alone_sends_no_encoder_and_mixed_models_beat_chance(head_run: dict[str, Any]) -> None:
    assert head_run["algorithm"] == "fedgen_head"
    assert all(r["clients"] == CLIENTS for r in head_run["rounds"]), head_run["rounds"]
    assert head_run["final_test_accuracy"] > 0.5  # chance is 0.1
    head_up = _size(HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32), 1000))
    down = {"model_weights": _size(ModelWeights(_generator())),  # the generator alone: no encoder either way
            "head_weights": _size(HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32)))}
    for r in head_run["rounds"]:
        if r["round"] <= ROUNDS:
            assert set(r["bytes_up"]) == {"head_weights", "class_counts", "eval_metrics", "envelope"}
            assert r["bytes_up"]["head_weights"] == CLIENTS * head_up
        if r["round"] > 1:
            assert set(r["bytes_down"]) == {*down, "envelope"}
            assert all(r["bytes_down"][kind] == CLIENTS * size for kind, size in down.items()), r["bytes_down"]


def test_the_aggregator_refuses_what_fedgen_does_not_declare(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    run = {"id": "r", "algorithm": "fedgen", "organizations": ["a", "b"], "rounds": 1, "seed": 3,
           "algorithm_config": {"num_classes": 3, "latent_dim": 2, "hidden_dim": 4, "noise_dim": 2,
                                "generator_steps": 2, "generator_batch_size": 4}}
    agg = aggregator(run)
    enc = np.ones((2, 5), np.float32)
    head = HeadWeights(np.zeros((3, 2), np.float32), np.zeros(3, np.float32), 8)
    declared = [(PayloadKind.MODEL_WEIGHTS, "encoder.weight", enc), (PayloadKind.HEAD_WEIGHTS, "weight", head.weight),
                (PayloadKind.HEAD_WEIGHTS, "bias", head.bias)]
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for c in (a, b):
        c.join(declared, examples=8)
    ins = a.pull()
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1 and not ins.payloads
    weights, counts = ModelWeights({"encoder.weight": enc}, 8), ClassCounts(np.array([4, 4, 0]))
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    logits = SeedPosteriors("s", np.arange(2, dtype=np.int64), np.full((2, 3), 1 / 3, np.float32), 0.0)
    msg = denied(lambda: a.push(1, [weights, head, counts, logits, metrics]))  # no posterior crosses
    assert "payload_kind_not_allowed" in msg and PayloadKind.SEED_POSTERIORS.value in msg
    with pytest.raises(grpc.RpcError) as err:  # an update without its label counts is incomplete
        a.push(1, [weights, head, metrics])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "class_counts" in str(err.value.details())
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 1
    # The round is unharmed: the valid updates are accepted, and round 2's instructions carry the averaged encoder
    # with the generator's tensors, and the averaged head.
    assert a.push(1, [weights, head, counts, metrics]).accepted
    assert b.push(1, [weights, head, ClassCounts(np.array([0, 2, 6])), metrics]).accepted
    ins = a.pull(completed=1)
    got = {codec.payload_kind_of(p): codec.payload_from_proto(p) for p in ins.payloads}
    assert set(got) == {PayloadKind.MODEL_WEIGHTS, PayloadKind.HEAD_WEIGHTS}
    sent = got[PayloadKind.MODEL_WEIGHTS]
    assert isinstance(sent, ModelWeights)
    assert sorted(sent.tensors) == sorted(["encoder.weight", *(GENERATOR_PREFIX + n for n in GENERATOR_TENSORS)])
    assert np.array_equal(sent.tensors["encoder.weight"], enc)
    assert sent.tensors[GENERATOR_PREFIX + "fc.weight"].shape == (4, 2 + 3)
