"""FedProto's client half on a tiny model: its objective against a hand computation (the reference code's
λ·MSELoss and the paper's squared distance), round 1 without the prototype term, the prototypes it uploads and
the prototype inference, all against float64 computations written out here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.fedproto import FedProtoClient, embedding_forward
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.training import Batch, summed
from hetfed.wire.payloads import ClassMeanEmbeddings, EvalMetrics, Received
from hetfed.wire.specs import get_spec

K, D, SHAPE = 3, 2, (4,)
SPEC = get_spec("fedproto")
CPU = torch.device("cpu")
# Classes 0 and 1 only: class 2 is one this organization lacks.
Y = np.array([0, 1, 0, 1, 1, 0, 1, 0], np.int64)
X = np.random.default_rng(7).standard_normal((Y.size, *SHAPE)).astype(np.float32)
TEST_Y = np.array([0, 1, 1, 0, 2], np.int64)
TEST_X = np.random.default_rng(8).standard_normal((TEST_Y.size, *SHAPE)).astype(np.float32)
# Global prototypes: classes 0 and 2 set, class 1 not yet (its row is junk and must not be read).
PROTOS = np.array([[0.5, -0.25], [99.0, 99.0], [1.5, 0.75]], np.float32)
PRESENT = np.array([True, False, True])


def received() -> Received:
    counts = np.array([12, 0, 7], np.int64)
    return Received([ClassMeanEmbeddings(np.arange(K, dtype=np.int64), PROTOS, counts, PRESENT)], frozenset())


def client(**fields: object) -> FedProtoClient:
    config = SPEC.config(latent_dim=D, num_classes=K, **fields)
    data = ClientData(ArrayDataset(X, Y), ArrayDataset(TEST_X, TEST_Y), None, K, SHAPE, "toy")
    half = client_half_type(SPEC)
    assert half is FedProtoClient
    model = half.make_model("mlp", SHAPE, K, seed=4, latent_dim=D, bounded_latent=False, config=config)
    return FedProtoClient(ClientContext("org-0", model, data, CPU, config, seed=4))


def batch() -> Batch:
    return Batch(torch.as_tensor(X), torch.as_tensor(Y))


def objective(half: FedProtoClient) -> float:
    out = embedding_forward(half.ctx.model, batch())
    return float(summed(half.terms(), batch(), out).detach())


def hand_terms(half: FedProtoClient, weight: float, distance: str) -> tuple[float, float]:
    """(cross-entropy, λ·L_R) in float64 from the model's own z and logits, example by example."""
    model = half.ctx.model
    with torch.no_grad():
        z = model.embed(torch.as_tensor(X)).double().numpy()
        logits = model.head(torch.as_tensor(z, dtype=torch.float32)).double()
    ce = float(F.cross_entropy(logits, torch.as_tensor(Y)))
    protos = PROTOS.astype(np.float64)
    if distance == "mse":
        # The reference code: proto_new = z, rows of classes with a global prototype replaced by it, then
        # nn.MSELoss (the mean over every row and dimension).
        target = z.copy()
        for i, y in enumerate(Y):
            if PRESENT[y]:
                target[i] = protos[y]
        reg = float(((target - z) ** 2).sum() / (z.shape[0] * z.shape[1]))
    else:
        reg = sum(float(((z[i] - protos[y]) ** 2).sum()) for i, y in enumerate(Y) if PRESENT[y]) / len(Y)
    return ce, weight * reg


def test_the_paper_and_reference_defaults() -> None:
    c = SPEC.config()
    assert (c.proto_weight, c.proto_distance, c.prototype_weighting) == (1.0, "mse", "uniform")
    assert (c.lr, c.momentum, c.local_epochs, c.batch_size, c.keep_optimizer_state) == (0.01, 0.5, 1, 8, False)


def test_round_one_trains_on_cross_entropy_alone() -> None:
    half = client()
    assert [getattr(t, "__name__", "") for t in half.terms()] == ["cross_entropy"]
    ce, _ = hand_terms(half, 1.0, "mse")
    assert objective(half) == pytest.approx(ce, rel=1e-6)


@pytest.mark.parametrize(("weight", "distance"), [(1.0, "mse"), (0.1, "mse"), (0.7, "squared_l2")])
def test_the_objective_is_cross_entropy_plus_lambda_times_the_prototype_distance(weight: float, distance: str) -> None:
    half = client(proto_weight=weight, proto_distance=distance)
    half._receive(received())
    ce, reg = hand_terms(half, weight, distance)
    assert reg > 0.01  # the term is there, and the junk row of class 1 is not in it
    assert objective(half) == pytest.approx(ce + reg, rel=1e-6)


def test_lambda_zero_leaves_cross_entropy_alone() -> None:
    half = client(proto_weight=0.0)
    half._receive(received())
    assert objective(half) == pytest.approx(hand_terms(half, 0.0, "mse")[0], rel=1e-6)


def test_a_training_step_follows_the_gradient_of_the_reference_codes_loss() -> None:
    """One full-batch step of plain SGD moves every weight by −lr·∇(CE + λ·MSELoss(proto_new, z)), the loss
    written as the reference code writes it (update.py: proto_new = z with the global prototypes put in)."""
    half = client(proto_weight=0.5, local_steps=1, batch_size=Y.size, lr=0.1, momentum=0.0)
    model = half.ctx.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    z = model.embed(torch.as_tensor(X))
    target = z.detach().clone()
    for i, y in enumerate(Y):
        if PRESENT[y]:
            target[i] = torch.as_tensor(PROTOS[y])
    loss = F.cross_entropy(model.head(z), torch.as_tensor(Y)) + 0.5 * torch.nn.MSELoss()(target, z)
    grads = dict(zip([n for n, _ in model.named_parameters()],
                     torch.autograd.grad(loss, list(model.parameters()), retain_graph=True), strict=True))
    # Without the prototype term the step would differ by more than the tolerance below.
    ce_grads = torch.autograd.grad(F.cross_entropy(model.head(z), torch.as_tensor(Y)), list(model.parameters()))
    assert max(float((g - c).abs().max()) for g, c in zip(grads.values(), ce_grads, strict=True)) > 1e-3
    half.train(2, 5, received())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] - 0.1 * grads[name], rtol=1e-5, atol=1e-6)


def test_the_uploaded_prototypes_are_the_class_means_of_the_trained_encoder() -> None:
    half = client()
    payloads = half.train(1, 11, received())
    cme, metrics = payloads
    assert isinstance(cme, ClassMeanEmbeddings) and isinstance(metrics, EvalMetrics)
    model = half.ctx.model
    model.eval()
    with torch.no_grad():
        z = model.embed(torch.as_tensor(X)).double().numpy()
    want = np.zeros((K, D))
    for k in (0, 1):
        want[k] = z[np.equal(Y, k)].mean(axis=0)
    np.testing.assert_allclose(cme.means, want.astype(np.float32), rtol=1e-6, atol=1e-7)
    assert cme.counts.tolist() == [4, 4, 0] and cme.presence.tolist() == [True, True, False]
    assert cme.labels.tolist() == [0, 1, 2]


def test_prototype_inference_picks_the_nearest_global_prototype_among_its_own_classes() -> None:
    half = client()
    assert half.prototype_accuracy() == 0.0  # no global prototype yet
    half._receive(received())
    model = half.ctx.model
    model.eval()
    with torch.no_grad():
        z = model.embed(torch.as_tensor(TEST_X)).double().numpy()
    # Own classes {0, 1} with a set prototype: {0} only, so every test example is called 0.
    assert half.prototype_accuracy() == pytest.approx(float(np.mean(TEST_Y == 0)))
    # With class 1 set too, the nearest of the two by Euclidean distance.
    protos = PROTOS.astype(np.float64).copy()
    protos[1] = [-0.5, 1.0]
    protos[2] = z.mean(axis=0)  # a class this organization lacks, nearest to some of its examples: never chosen
    counts = np.array([12, 3, 7], np.int64)
    half._receive(Received([ClassMeanEmbeddings(np.arange(K, dtype=np.int64), protos.astype(np.float32), counts,
                                                 counts > 0)], frozenset()))
    dist = ((z[:, None, :2] - protos[None, :2]) ** 2).sum(axis=2)
    want = float(np.mean(dist.argmin(axis=1) == TEST_Y))
    assert (((z[:, None, :] - protos[None]) ** 2).sum(axis=2).argmin(axis=1) == 2).any()
    assert half.prototype_accuracy() == pytest.approx(want)
    assert half.evaluate(2, Received([], frozenset())).extra["prototype_test_accuracy"] == pytest.approx(want)


def test_a_restarted_client_keeps_the_last_global_prototypes() -> None:
    """The prototypes received last are private state: a resumed half trains toward them as the first would."""
    half = client()
    half.train(1, 3, received())
    fresh = client()
    assert fresh.prototypes is None
    fresh.load_private_state(half.private_state())
    assert fresh.prototypes is not None and torch.equal(fresh.prototypes, half.prototypes)
    nothing = Received([], frozenset())
    a, b = half.train(2, 4, nothing)[0], fresh.train(2, 4, nothing)[0]
    assert isinstance(a, ClassMeanEmbeddings) and isinstance(b, ClassMeanEmbeddings)
    assert a.means.tobytes() == b.means.tobytes()
