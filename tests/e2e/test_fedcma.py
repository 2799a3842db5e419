"""Fed-CMA end to end: a real run over loopback, the contract refusing encoder weights, every uploaded byte."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
K, D = 4, 2  # gauss4: four classes, a 2-D latent space
CLIENTS, ROUNDS = 4, 3


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """``hetfed run --algorithm fedcma_paper --dataset gauss4`` as a user runs it (real processes, loopback gRPC):
    the paper form, whose sigmoid bounds the latents drawn here."""
    out = tmp_path_factory.mktemp("fedcma") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedcma_paper", "--dataset", "gauss4",
         "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--local-epochs", "1", "--lr", "0.1",
         "--momentum", "0.9", "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    (run,) = results["runs"]
    return run, out


def test_a_short_gauss4_run_finishes_and_draws_its_latent_spaces(toy_run: tuple[dict[str, Any], Path]) -> None:
    run, out = toy_run
    assert run["algorithm"] == "fedcma_paper"
    assert [r["round"] for r in run["rounds"]] == [0, 1, 2, 3, 4]  # setup, three training rounds, evaluate
    assert run["final_test_accuracy"] > 0.5
    png = out / "gauss4-fedcma-paper.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # The picture comes from the run's own models: every organization wrote its snapshots locally.
    for i in range(CLIENTS):
        meta = json.loads((out / "artifacts" / "fedcma-paper" / f"org-{i}" / "meta.json").read_text())
        assert meta["latent_dim"] == D and meta["num_classes"] == K
        with np.load(out / "artifacts" / "fedcma-paper" / f"org-{i}" / "final.npz") as snap:
            z = snap["probe_z"]
            assert z.shape == (400, D) and z.min() >= 0.0 and z.max() <= 1.0  # bounded latents


def test_an_unbounded_latent_run_keeps_its_encoders_own_range(tmp_path: Path) -> None:
    """bounded_latent = false: no sigmoid is added to the linear encoder, latents leave [0, 1] and the aggregator
    accepts their means."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedcma", "--dataset", "gauss4", "--clients", "2",
         "--rounds", "2", "--local-epochs", "1", "--lr", "0.1", "--model", "linear", "--set", "bounded_latent=false",
         "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert [r["round"] for r in run["rounds"]] == [0, 1, 2, 3]
    assert all(r["clients"] == 2 for r in run["rounds"][1:3]), run["rounds"]  # every upload accepted
    outside = 0
    for i in range(2):
        with np.load(out / "artifacts" / "fedcma" / f"org-{i}" / "final.npz") as snap:
            z = snap["probe_z"]
            outside += int(((z < 0.0) | (z > 1.0)).sum())
    assert outside > 0


def _size(payload: Payload) -> int:
    """Bytes a payload takes inside an Update (what the aggregator's traffic accounting attributes to its kind)."""
    return embedded_size(codec.payload_to_proto(payload).ByteSize())


def test_every_uploaded_byte_is_counts_means_head_metrics_or_envelope(toy_run: tuple[dict[str, Any], Path]) -> None:
    from hetfed.client.data import DataConfig, load_client_data

    run, _ = toy_run
    train_sizes = [len(load_client_data(DataConfig(dataset="gauss4", partition="natural", num_clients=CLIENTS,
                                                   client_index=i)).train) for i in range(CLIENTS)]
    # Sizes of each payload follow from K and d_e alone (and, for the head, the example count's varint).
    counts = _size(ClassCounts(np.zeros(K, np.int64)))
    means = _size(ClassMeanEmbeddings(np.zeros(K, np.int64), np.zeros((K, D), np.float32),
                                      np.zeros(K, np.int64), np.zeros(K, bool)))
    heads = sum(_size(HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32), n)) for n in train_sizes)
    # The smallest tensor of any organization's encoder (the MLP's first layer, 2 x 200 floats).
    smallest_encoder_tensor = 2 * 200 * 4
    for r in run["rounds"]:
        up = r["bytes_up"]
        if r["round"] == 0:
            assert set(up) == {"class_counts", "envelope"}
            assert up["class_counts"] == CLIENTS * counts
        elif r["round"] <= ROUNDS:
            assert set(up) == {"class_mean_embeddings", "head_weights", "eval_metrics", "envelope"}
            assert up["class_mean_embeddings"] == CLIENTS * means  # K x d_e means + labels, counts, presence
            assert up["head_weights"] == heads  # weight K x d_e and bias K
        else:
            assert set(up) == {"eval_metrics", "envelope"}
        # What is left (metrics and envelope) is too small to hide even one encoder tensor.
        rest = up.get("eval_metrics", 0) + up["envelope"]
        assert rest / CLIENTS < smallest_encoder_tensor / 2, r
        assert "model_weights" not in up and "model_weights" not in r["bytes_down"]
    assert means + heads / CLIENTS < 256  # the whole per-round payload of one organization, in bytes


# ---------------------------------------------------------------------------------------------- contract
def encoder_weights() -> ModelWeights:
    """A real organization's encoder weights (the thing Fed-CMA must never let out)."""
    from hetfed.client.models import build_model, state_arrays

    model = build_model("mlp", (2,), K, latent_dim=D, bounded_latent=True)
    return ModelWeights(state_arrays(model.encoder), 20)


def test_the_aggregator_refuses_encoder_weights_under_fedcma(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    run = {"id": "r", "algorithm": "fedcma", "organizations": ["a", "b"], "rounds": 1,
           "algorithm_config": {"latent_dim": D, "num_classes": K}}
    agg = aggregator(run)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join()
    b.join()
    ins = a.pull()
    assert ins.action == apb.ACTION_SETUP and ins.envelope.round == 0 and not ins.payloads
    enc = encoder_weights()
    # Setup: only class counts.
    msg = denied(lambda: a.push(0, [enc]))
    assert "payload_kind_not_allowed" in msg and "model_weights" in msg
    a.push(0, [ClassCounts(np.array([5, 5, 5, 5], np.int64))])
    b.push(0, [ClassCounts(np.array([1, 2, 3, 4], np.int64))])
    ins = a.pull(completed=0)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1
    kinds = {codec.payload_kind_of(p) for p in ins.payloads}
    assert kinds == {PayloadKind.CLASS_MEAN_EMBEDDINGS, PayloadKind.HEAD_WEIGHTS}
    head = HeadWeights(np.zeros((K, D), np.float32), np.zeros(K, np.float32), 20)
    means = ClassMeanEmbeddings(np.arange(K), np.full((K, D), 0.5, np.float32), np.full(K, 4), np.ones(K, bool))
    metrics = EvalMetrics(train_loss=1.0, test_accuracy=0.5, num_test_examples=4)
    # Training: encoder weights alone, or smuggled beside a valid update, are refused.
    assert "payload_kind_not_allowed" in denied(lambda: a.push(1, [enc]))
    assert "payload_kind_not_allowed" in denied(lambda: a.push(1, [means, head, enc, metrics]))
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": "r", "reason": "payload_kind_not_allowed"})
    assert value == 3
    # The round is unharmed: the organization's valid update is still accepted.
    assert a.push(1, [means, head, metrics]).accepted
