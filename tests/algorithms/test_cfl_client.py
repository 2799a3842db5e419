"""CFL's client half on a tiny linear model: the setup sends the initial model; a round loads the cluster's model,
scores it, takes one SGD step of cross-entropy and sends the weight update, against a float64 hand computation."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.cfl import CFLClient
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Received
from hetfed.wire.specs import get_spec

K, D = 3, 4
SPEC = get_spec("cfl")
CPU = torch.device("cpu")
rng = np.random.default_rng(7)
Y = np.array([0, 1, 2, 1, 0, 2], np.int64)
X = rng.standard_normal((Y.size, 1, 2, 2)).astype(np.float32)
W0 = rng.standard_normal((K, D)).astype(np.float32)
B0 = rng.standard_normal(K).astype(np.float32)
# The cluster's model the aggregator sends.
WC = rng.standard_normal((K, D)).astype(np.float32)
BC = rng.standard_normal(K).astype(np.float32)
LR = 0.5


def linear() -> SplitModel:
    model = SplitModel(nn.Flatten(), D, K)
    with torch.no_grad():
        model.head.weight.copy_(torch.as_tensor(W0))
        model.head.bias.copy_(torch.as_tensor(B0))
    return model


def client() -> CFLClient:
    config = SPEC.config(lr=LR, momentum=0.0, batch_size=64, local_epochs=1, lr_decay=1.0)
    data = ClientData(ArrayDataset(X, Y), ArrayDataset(X, Y), None, K, (1, 2, 2), "toy")
    assert client_half_type(SPEC) is CFLClient
    return CFLClient(ClientContext("org-0", linear(), data, CPU, config, seed=4))


def cluster_model() -> Received:
    return Received([ModelWeights({"head.weight": WC.copy(), "head.bias": BC.copy()})])


def hand_step() -> tuple[np.ndarray, np.ndarray]:
    """−lr·∇ of the mean cross-entropy at the cluster's model, over the six examples, in float64."""
    x = X.reshape(Y.size, D).astype(np.float64)
    w, b = WC.astype(np.float64), BC.astype(np.float64)
    gw, gb = np.zeros((K, D)), np.zeros(K)
    for i in range(Y.size):
        z = w @ x[i] + b
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        p[Y[i]] -= 1.0
        gw += np.outer(p, x[i]) / Y.size
        gb += p / Y.size
    return -LR * gw, -LR * gb


def test_the_setup_sends_the_initial_model() -> None:
    (mw,) = client().setup(1)
    assert isinstance(mw, ModelWeights) and mw.num_examples == Y.size
    assert mw.tensors["head.weight"].tobytes() == W0.tobytes() and mw.tensors["head.bias"].tobytes() == B0.tobytes()


def test_a_round_sends_the_update_of_the_cluster_model() -> None:
    half = client()
    update, metrics = half.train(1, 11, cluster_model())
    assert isinstance(update, ModelWeights) and isinstance(metrics, EvalMetrics)
    assert update.num_examples == Y.size and sorted(update.tensors) == ["head.bias", "head.weight"]
    # Exactly what training moved the received model by ...
    trained = half.ctx.model.head
    assert update.tensors["head.weight"].tobytes() == (trained.weight.detach().numpy() - WC).tobytes()
    assert update.tensors["head.bias"].tobytes() == (trained.bias.detach().numpy() - BC).tobytes()
    # ... one SGD step of cross-entropy from the cluster's model, not from the organization's own.
    dw, db = hand_step()
    np.testing.assert_allclose(update.tensors["head.weight"], dw, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(update.tensors["head.bias"], db, rtol=1e-5, atol=1e-7)
    # The metrics score the received model, before training.
    logits = X.reshape(Y.size, D).astype(np.float64) @ WC.T.astype(np.float64) + BC
    assert metrics.test_accuracy == float(np.mean(logits.argmax(1) == Y))
    assert metrics.train_loss > 0


def test_the_final_evaluation_scores_the_cluster_model() -> None:
    half = client()
    half.train(1, 11, cluster_model())
    final = half.evaluate(2, cluster_model())
    logits = X.reshape(Y.size, D).astype(np.float64) @ WC.T.astype(np.float64) + BC
    assert final.test_accuracy == float(np.mean(logits.argmax(1) == Y))
    assert half.ctx.model.head.weight.detach().numpy().tobytes() == WC.tobytes()

