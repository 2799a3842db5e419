"""FedFomo's client half: the first-order weights and the update against hand-computed numbers; on a tiny linear
model, the weights of received models against a float64 computation of their validation losses and L1
distances, the move toward the helpful ones, and no move when none helps; the validation split; the round's
uploads."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch import nn

from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.fedfomo import FedFomoClient, first_order_update, fomo_weights, update_weights
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PeerWeights, Received
from hetfed.wire.specs import get_spec

K, D, N = 2, 4, 20
SPEC = get_spec("fedfomo")
CPU = torch.device("cpu")
rng = np.random.default_rng(7)
X = rng.standard_normal((N, 1, 2, 2)).astype(np.float32)
Y = (X[:, 0, 0, 0] > 0).astype(np.int64)  # the class is the sign of the first feature


def linear(weight: npt.ArrayLike, bias: npt.ArrayLike) -> dict[str, np.ndarray]:
    return {"head.weight": np.asarray(weight, np.float32), "head.bias": np.asarray(bias, np.float32)}


GOOD = linear([[-3.0, 0, 0, 0], [3.0, 0, 0, 0]], [0.0, 0.0])  # separates the classes
FLAT = linear(np.zeros((K, D)), [0.0, 0.0])  # ln 2 everywhere
BAD = linear([[3.0, 0, 0, 0], [-3.0, 0, 0, 0]], [0.0, 0.0])  # inverted
MID = linear([[-1.0, 0.2, 0, 0], [1.0, 0, -0.1, 0]], [0.1, -0.1])


def client(**fields: object) -> FedFomoClient:
    config = SPEC.config(**{"local_epochs": 1, "batch_size": 4, **fields})
    data = ClientData(ArrayDataset(X, Y), ArrayDataset(X, Y), None, K, (1, 2, 2), "toy")
    assert client_half_type(SPEC) is FedFomoClient
    assert FedFomoClient.privacy_mechanism is None  # the validation losses behind the weights escape DP-SGD
    model = SplitModel(nn.Flatten(), D, K)
    return FedFomoClient(ClientContext("org-0", model, data, CPU, config, seed=4,
                                       build_model=lambda: SplitModel(nn.Flatten(), D, K)))


def load(half: FedFomoClient, tensors: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, p in half.ctx.model.named_parameters():
            p.copy_(torch.from_numpy(tensors[name]))


def val_arrays(half: FedFomoClient) -> tuple[np.ndarray, np.ndarray]:
    x, y = half.val.x.numpy().reshape(-1, D).astype(np.float64), half.val.y.numpy()  # type: ignore[union-attr]
    return x, y


def hand_loss(x: np.ndarray, y: np.ndarray, t: dict[str, np.ndarray]) -> float:
    """Mean cross-entropy, float64, written out."""
    logits = x @ t["head.weight"].astype(np.float64).T + t["head.bias"].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return float(np.mean(log_z - logits[np.arange(y.size), y]))


def l1(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(sum(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).sum() for k in a))


def peers(*models: dict[str, np.ndarray]) -> Received:
    names = PeerWeights(tuple(f"peer-{i}" for i in range(len(models))), np.zeros(len(models), np.float32))
    return Received([names, *(ModelWeights(m) for m in models)], SPEC.repeated_download)


def state(half: FedFomoClient) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in half.ctx.model.named_parameters()}


def test_the_weights_are_loss_gains_per_l1_distance_and_only_positive_ones_move_the_model() -> None:
    # L(φ) = 1.0; gains 0.5, −0.25, 0.125 over distances 2, 4, 0.5 (numbers exact in binary).
    w = fomo_weights(1.0, [0.5, 1.25, 0.875], [2.0, 4.0, 0.5])
    assert w.tolist() == [0.25, -0.0625, 0.25]
    step = update_weights(w)
    assert step is not None and step.tolist() == [0.5, 0.0, 0.5]  # max(w, 0) / (0.25 + 0.25)
    assert update_weights(np.array([-0.1, -3.0, 0.0])) is None  # nothing helps: keep φ
    assert fomo_weights(1.0, [0.5], [0.0]).tolist() == [0.0]  # no distance, no direction
    # φ + 0.75·(θ₁ − φ) + 0.25·(θ₂ − φ)
    new = first_order_update({"w": np.array([1.0, 2.0, 3.0])},
                             [{"w": np.array([3.0, 2.0, 1.0])}, {"w": np.array([1.0, 0.0, 3.0])}],
                             np.array([0.75, 0.25]))
    assert new["w"].tolist() == [2.5, 1.5, 1.5]


def test_the_validation_split_is_seeded_disjoint_and_leaves_the_rest_for_training() -> None:
    a, b = client(), client()
    assert len(a.val) == 4 and len(a.ctx.train) == 16 and a.ctx.num_examples == 16
    xs = np.concatenate([a.val.x.numpy(), a.ctx.train.x.numpy()])  # type: ignore[union-attr]
    assert sorted(map(bytes, xs)) == sorted(map(bytes, X))  # every example once
    assert np.array_equal(a.val.x.numpy(), b.val.x.numpy())  # type: ignore[union-attr]
    data = ClientData(ArrayDataset(X[:2], Y[:2]), ArrayDataset(X, Y), None, K, (1, 2, 2), "toy")
    with pytest.raises(ValueError, match="leave 0 for validation"):
        FedFomoClient(ClientContext("o", SplitModel(nn.Flatten(), D, K), data, CPU, SPEC.config(), seed=1))


def test_received_models_are_weighed_on_the_validation_split_and_the_model_moves_toward_the_helpful() -> None:
    half = client()
    half.start = {k: torch.from_numpy(v.copy()) for k, v in FLAT.items()}  # φ
    load(half, MID)  # θ, the organization's own trained model
    report, extra = half.weigh(peers(GOOD, BAD))
    x, y = val_arrays(half)
    base = hand_loss(x, y, FLAT)
    models = [MID, GOOD, BAD]
    want = np.array([(base - hand_loss(x, y, m)) / l1(m, FLAT) for m in models])
    assert report is not None and report.organizations == ("org-0", "peer-0", "peer-1")
    np.testing.assert_allclose(report.weights, want, rtol=1e-5)
    assert want[0] > 0 and want[1] > 0 and want[2] < 0 and extra["fomo_helpful_models"] == 2
    step = np.maximum(want, 0) / np.maximum(want, 0).sum()
    moved = {k: FLAT[k] + sum(s * (m[k].astype(np.float64) - FLAT[k]) for s, m in zip(step, models, strict=True))
             for k in FLAT}
    for k, v in state(half).items():
        np.testing.assert_allclose(v, moved[k], rtol=1e-5, atol=1e-6)


def test_when_no_model_helps_the_organization_keeps_its_start_and_drops_its_training() -> None:
    half = client()
    half.start = {k: torch.from_numpy(v.copy()) for k, v in GOOD.items()}
    load(half, MID)
    report, extra = half.weigh(peers(BAD, FLAT))
    assert report is not None and (report.weights < 0).all() and extra["fomo_helpful_models"] == 0
    assert all(np.array_equal(v, GOOD[k]) for k, v in state(half).items())


def test_round_one_sends_no_weights_and_later_rounds_report_every_model_weighed() -> None:
    half = client()
    first = half.train(1, 3, Received([], SPEC.repeated_download))
    assert [type(p) for p in first] == [ModelWeights, EvalMetrics]
    assert set(half.start) == {"head.weight", "head.bias"}
    second = half.train(2, 4, peers(GOOD))
    assert [type(p) for p in second] == [ModelWeights, PeerWeights, EvalMetrics]
    assert second[1].organizations == ("org-0", "peer-0")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="2 models named by 1 organizations"):
        half.weigh(Received([PeerWeights(("x",), np.zeros(1, np.float32)), ModelWeights(GOOD), ModelWeights(BAD)],
                            SPEC.repeated_download))
