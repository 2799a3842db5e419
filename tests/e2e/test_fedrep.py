"""FedRep and FedPer end to end: ``hetfed run`` starts a real aggregator and real client processes over loopback
gRPC. Both beat chance on gauss4, and each organization's upload is its body: FedAvg's upload of the same model
is larger by exactly the encoded head tensors, for each organization, every round."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetfed.client.algorithms.fedavg import model_weights
from hetfed.client.models import build_model
from hetfed.wire import codec
from tests.e2e.test_local_run import hetfed_run

pytestmark = pytest.mark.e2e
CLIENTS, ROUNDS, CLASSES = 2, 3, 4


def test_fedrep_and_fedper_beat_chance_and_send_the_body_alone(tmp_path: Path) -> None:
    runs = hetfed_run(tmp_path, "--algorithm", "fedrep,fedper,fedavg", "--dataset", "gauss4", "--clients",
                      str(CLIENTS), "--rounds", str(ROUNDS), "--local-epochs", "3")
    # gauss4: 4 classes, so chance is 25%; FedRep's personal heads reach 86% here (seed 0).
    assert runs["fedrep"]["final_test_accuracy"] > 0.5
    assert runs["fedper"]["final_test_accuracy"] > 1 / CLASSES
    # gauss4's model: the MLP encoder to a latent of 2, a head Linear(2, 4); what the head adds to an upload.
    model = build_model("mlp", (2,), CLASSES, seed=0, latent_dim=2, bounded_latent=False)
    whole = model_weights(model, 100)
    body = dataclasses.replace(whole, tensors={k: v for k, v in whole.tensors.items() if not k.startswith("head.")})
    head_bytes = codec.payload_to_proto(whole).ByteSize() - codec.payload_to_proto(body).ByteSize()
    assert head_bytes == 95  # 12 float32 values (48 bytes) and their names, shapes and framing
    up = {name: [r["bytes_up"].get("model_weights", 0) for r in run["rounds"]] for name, run in runs.items()}
    down = {name: [r["bytes_down"].get("model_weights", 0) for r in run["rounds"]] for name, run in runs.items()}
    assert up["fedrep"] == up["fedper"] and down["fedrep"] == down["fedper"]
    assert all(n > 0 for n in up["fedrep"][:ROUNDS])
    assert [a - b for a, b in zip(up["fedavg"], up["fedrep"], strict=True)] == [CLIENTS * head_bytes] * ROUNDS + [0]
