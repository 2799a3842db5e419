"""FML's client half: the two mutual losses against a float64 hand computation, one step of the real half against
a float64 replay of the authors' step (both outputs first, then both models step), what it declares, uploads and
reports, and which optimiser it keeps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.fml import MEME_OPTIMIZER, FMLClient, mutual_values
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.models import SplitModel, build_model
from hetfed.client.training import evaluate
from hetfed.wire.config import ConfigError
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind, Received
from hetfed.wire.specs import get_spec

K, D = 3, 4
SPEC = get_spec("fml")
CPU = torch.device("cpu")
rng = np.random.default_rng(7)
Y = np.array([0, 1, 2, 1, 0, 2], np.int64)
X = rng.standard_normal((Y.size, 1, 2, 2)).astype(np.float32)
W0 = rng.standard_normal((K, D))
B0 = rng.standard_normal(K)
NOTHING = Received([], frozenset())


def private_model() -> SplitModel:
    """A linear private model: flatten, then the head Linear(4, 3)."""
    model = SplitModel(nn.Flatten(), D, K)
    with torch.no_grad():
        model.head.weight.copy_(torch.as_tensor(W0))
        model.head.bias.copy_(torch.as_tensor(B0))
    return model


def client(**fields: object) -> FMLClient:
    config = SPEC.config(**{"meme_model": "linear", "lr": 0.5, "momentum": 0.0, "batch_size": Y.size,
                            "local_epochs": 1, **fields})
    data = ClientData(ArrayDataset(X, Y), ArrayDataset(X, Y), None, K, (1, 2, 2), "toy")
    assert client_half_type(SPEC) is FMLClient
    return FMLClient(ClientContext("org-0", private_model(), data, CPU, config, seed=4))


def softmax64(z: list[float]) -> list[float]:
    e = [math.exp(v - max(z)) for v in z]
    return [v / sum(e) for v in e]


def hand(logits: list[list[float]], peer: list[list[float]], labels: list[int], w: float) -> list[float]:
    """w·(−log p_y) + (1 − w)·Σ_k q_k·log(q_k / p_k), row by row in float64."""
    out = []
    for z, u, y in zip(logits, peer, labels, strict=True):
        p, q = softmax64(z), softmax64(u)
        out.append(w * -math.log(p[y]) + (1 - w) * sum(qk * math.log(qk / pk) for qk, pk in zip(q, p, strict=True)))
    return out


def test_the_mutual_loss_is_the_float64_hand_computation() -> None:
    # p = (1/2, 1/2), q = (3/4, 1/4), y = 0: CE = ln 2, KL(q ‖ p) = 3/4·ln(3/2) + 1/4·ln(1/2).
    z = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    u = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)
    got = mutual_values(z, u, torch.tensor([0]), 0.5)
    exact = 0.5 * math.log(2) + 0.5 * (0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert got.tolist() == pytest.approx([exact], rel=1e-15)
    logits = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [-2.0, 0.25, 0.0]]
    peer = [[0.2, 0.1, -0.4], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]
    labels = [1, 2, 0]
    for w in (0.0, 0.3, 0.5, 1.0):
        got = mutual_values(torch.tensor(logits, dtype=torch.float64), torch.tensor(peer, dtype=torch.float64),
                            torch.tensor(labels), w)
        assert got.tolist() == pytest.approx(hand(logits, peer, labels, w), rel=1e-13, abs=1e-15)


def test_the_batch_mean_is_the_reference_codes_cross_entropy_and_batchmean_kl() -> None:
    g = torch.Generator().manual_seed(0)
    z, u = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 3, 1, 1, 2])
    kl = nn.KLDivLoss(reduction="batchmean")(nn.LogSoftmax(dim=1)(z), nn.Softmax(dim=1)(u))
    for a in (0.1, 0.5, 0.9):
        want = a * nn.CrossEntropyLoss()(z, y) + (1 - a) * kl
        assert float(mutual_values(z, u, y, a).mean()) == pytest.approx(float(want), rel=1e-14)


def test_no_gradient_reaches_the_peer() -> None:
    z = torch.tensor([[0.3, -0.2, 1.0]], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    mutual_values(z, u, torch.tensor([2]), 0.5).sum().backward()
    assert u.grad is None and z.grad is not None
    # d/dz [α·CE + (1 − α)·KL(q ‖ p)] = α·(p − e_y) + (1 − α)·(p − q), as a float64 hand computation.
    p, q = softmax64([0.3, -0.2, 1.0]), softmax64([1.0, 0.0, -1.0])
    want = [0.5 * (p[k] - (k == 2)) + 0.5 * (p[k] - q[k]) for k in range(3)]
    assert z.grad[0].tolist() == pytest.approx(want, rel=1e-13)


def _params64(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to(torch.float64).clone().requires_grad_(True) for p in model.parameters()]


def test_one_round_of_the_real_half_is_the_reference_step_in_float64() -> None:
    """One batch (the whole toy set): both logits first, then each model's SGD step with weight decay on its own
    loss, the other's output fixed (Trainer.py:78-89, Node.py:22), replayed in float64."""
    alpha, beta, lr, wd = 0.3, 0.8, 0.5, 0.01
    half = client(alpha=alpha, beta=beta, weight_decay=wd)
    meme0, private0 = _params64(half.meme), _params64(half.ctx.model)
    x = torch.as_tensor(X, dtype=torch.float64).reshape(Y.size, D)
    y = torch.as_tensor(Y)
    # The meme model "linear": encoder Linear(4, 20), head Linear(20, 3); the private model: head Linear(4, 3).
    we, be, wh, bh = meme0
    z_meme = (x @ we.T + be) @ wh.T + bh
    z_private = x @ private0[0].T + private0[1]
    ce, kl = nn.CrossEntropyLoss(), nn.KLDivLoss(reduction="batchmean")
    loss_private = alpha * ce(z_private, y) + (1 - alpha) * kl(torch.log_softmax(z_private, 1),
                                                               torch.softmax(z_meme.detach(), 1))
    loss_meme = beta * ce(z_meme, y) + (1 - beta) * kl(torch.log_softmax(z_meme, 1),
                                                       torch.softmax(z_private.detach(), 1))
    g_private = torch.autograd.grad(loss_private, private0)
    g_meme = torch.autograd.grad(loss_meme, meme0)
    upload = half.train(1, 11, NOTHING)
    for p, p0, g in [*zip(half.ctx.model.parameters(), private0, g_private, strict=True),
                     *zip(half.meme.parameters(), meme0, g_meme, strict=True)]:
        want = p0.detach() - lr * (g + wd * p0.detach())
        np.testing.assert_allclose(p.detach().double().numpy(), want.numpy(), rtol=0, atol=2e-6)
    weights, metrics = upload
    assert isinstance(weights, ModelWeights) and isinstance(metrics, EvalMetrics)
    # The meme model goes up, its state after the step, with the example count; nothing of the private model.
    assert set(weights.tensors) == set(half.meme.state_dict()) and weights.num_examples == Y.size
    for name, value in half.meme.state_dict().items():
        np.testing.assert_array_equal(weights.tensors[name], value.numpy())
    assert metrics.train_loss == pytest.approx(loss_private.item(), rel=1e-6)
    assert metrics.extra["meme_train_loss"] == pytest.approx(loss_meme.item(), rel=1e-6)


def test_it_declares_the_meme_model_only_whatever_the_private_architecture() -> None:
    half = client(meme_model="mlp")
    declared = half.declarations(None)
    assert {d.kind for d in declared} == {PayloadKind.MODEL_WEIGHTS}
    assert {d.name: d.decl.shape for d in declared} == {k: tuple(v.shape) for k, v in half.meme.state_dict().items()}
    # The private model's head (Linear(4, 3)) is not the meme model's (Linear(64, 3)): its shape is not declared.
    assert tuple(half.meme.head.weight.shape) == (K, 64) != tuple(half.ctx.model.head.weight.shape)


def test_the_meme_model_starts_alike_everywhere_and_not_as_the_private_model() -> None:
    a, b = client(meme_model="linear"), client(meme_model="linear")
    for pa, pb in zip(a.meme.parameters(), b.meme.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # An organization whose private model is the meme's architecture, built with the run seed as the runtime does.
    own = build_model("linear", (1, 2, 2), K, seed=4)
    same_arch = FMLClient(ClientContext("org-1", own, a.ctx.data, CPU, SPEC.config(meme_model="linear"), seed=4))
    assert not torch.equal(same_arch.meme.head.weight, same_arch.ctx.model.head.weight)


def test_round_two_forks_the_received_model_with_a_fresh_meme_optimiser_and_keeps_the_private_one() -> None:
    half = client(momentum=0.9)
    half.train(1, 11, NOTHING)
    private_opt, meme_opt = half.optimizer(), half._optimizers[MEME_OPTIMIZER]
    assert any(s for s in private_opt.state.values())
    global_ = {k: np.full(v.shape, 0.01, np.float32) for k, v in half.meme.state_dict().items()}
    before = {k: v.clone() for k, v in half.ctx.model.state_dict().items()}
    received = Received([ModelWeights(global_, 12)], frozenset())
    half.load(received)
    assert all(torch.equal(v, torch.full_like(v, 0.01)) for v in half.meme.state_dict().values())
    assert all(torch.equal(v, before[k]) for k, v in half.ctx.model.state_dict().items())  # never overwritten
    half.train(2, 12, received)
    assert half.optimizer() is private_opt and half._optimizers[MEME_OPTIMIZER] is not meme_opt
    assert MEME_OPTIMIZER not in half.private_state() and "optimizer" in half.private_state()


def test_evaluate_reports_the_private_model_and_the_averaged_meme_models_accuracy() -> None:
    half = client()
    half.train(1, 11, NOTHING)
    global_ = {k: (v.numpy() * 0.5).astype(np.float32) for k, v in half.meme.state_dict().items()}
    report = half.evaluate(2, Received([ModelWeights(global_, 12)], frozenset()))
    acc, loss = evaluate(half.ctx.model, half.ctx.test)
    assert report.test_accuracy == acc and report.test_loss == pytest.approx(loss)
    assert report.extra["meme_model_test_accuracy"] == evaluate(half.meme, half.ctx.test)[0]
    assert report.extra["evaluated_round"] == 1.0


def test_runs_are_deterministic() -> None:
    a, b = client(momentum=0.9, local_epochs=2, batch_size=4), client(momentum=0.9, local_epochs=2, batch_size=4)
    ua, ub = a.train(1, 5, NOTHING), b.train(1, 5, NOTHING)
    for name, value in ua[0].tensors.items():
        np.testing.assert_array_equal(value, ub[0].tensors[name])


def test_fml_refuses_privacy_and_is_not_model_private() -> None:
    assert FMLClient.privacy_mechanism is None  # the runtime refuses [privacy] at Join
    assert not SPEC.model_private and SPEC.mixed_architectures


@pytest.mark.parametrize(("fields", "message"), [
    ({"alpha": 1.5}, "alpha must be in [0, 1], got 1.5"),
    ({"beta": -0.1}, "beta must be in [0, 1], got -0.1"),
    ({"meme_model": " "}, "meme_model must name an architecture"),
])
def test_config_validation(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SPEC.config(**fields)
