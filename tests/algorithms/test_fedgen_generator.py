"""FedGen's numpy generator: its forward pass, loss and gradients against a float64 torch reference built as
the authors' code builds it (nn.Linear, BatchNorm1d in training mode, ReLU; the teacher loss of
servers/serverpFedGen.py:145-154 and the DiversityLoss of trainmodel/generator.py:176-218), against central
finite differences, and its Adam step and BatchNorm statistics against torch's; the label weights and the
loss terms by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.aggregator.algorithms.fedgen import (
    TRAINED,
    Adam,
    diversity_loss,
    eval_forward,
    forward,
    init_generator,
    label_weights,
    loss_and_grads,
    teacher_loss,
    update_running,
)

B, NOISE, K, HIDDEN, LATENT, ORGS = 6, 4, 3, 5, 4, 3


def setup(seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]],
                                  np.ndarray]:
    rng = np.random.default_rng(seed)
    params = init_generator(rng, NOISE, K, HIDDEN, LATENT)
    params["bn.weight"] = rng.uniform(0.5, 1.5, HIDDEN)  # away from the initial 1 and 0, so γ and β matter
    params["bn.bias"] = rng.uniform(-0.3, 0.3, HIDDEN)
    eps = rng.random((B, NOISE))
    labels = np.array([0, 2, 1, 2, 0, 1])
    heads = [(rng.normal(size=(K, LATENT)), rng.normal(size=K)) for _ in range(ORGS)]
    weights, _ = label_weights(rng.integers(0, 9, (ORGS, K)))
    return params, eps, labels, heads, weights[labels]


class TorchGenerator(nn.Module):
    """The reference code's Generator (one hidden layer, one-hot labels), in float64, noise given."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(NOISE + K, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, LATENT)
        self.double()
        self.load_state_dict({n: torch.tensor(a) for n, a in params.items()}, strict=False)

    def forward(self, eps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(labels.shape[0], K, dtype=torch.float64)
        y.scatter_(1, labels.view(-1, 1), 1)
        return self.out(F.relu(self.bn(self.fc(torch.cat((eps, y), dim=1)))))


def torch_loss(gen: TorchGenerator, eps: np.ndarray, labels: np.ndarray, heads: list[tuple[np.ndarray, np.ndarray]],
               weights: np.ndarray, alpha: float, eta: float) -> torch.Tensor:
    """α·teacher + η·diversity, term by term as the reference code writes them."""
    e, y = torch.tensor(eps), torch.tensor(labels)
    out = gen(e, y)
    teacher = torch.zeros((), dtype=torch.float64)
    for k, (w, b) in enumerate(heads):
        logp = F.log_softmax(out @ torch.tensor(w).T + torch.tensor(b), dim=1)
        teacher = teacher + torch.mean(nn.NLLLoss(reduction="none")(logp, y) * torch.tensor(weights[:, k]))
    layer = torch.abs(out.expand((B, B, LATENT)) - out.unsqueeze(1)).mean(dim=2)
    noise = torch.pow(e.expand((B, B, NOISE)) - e.unsqueeze(1), 2).mean(dim=2)
    diversity = torch.exp(torch.mean(-noise * layer))
    return alpha * teacher + eta * diversity


@pytest.mark.parametrize(("alpha", "eta"), [(1.0, 1.0), (1.0, 0.0), (0.0, 1.0), (0.7, 2.5)])
def test_loss_and_every_gradient_match_a_float64_torch_reference(alpha: float, eta: float) -> None:
    params, eps, labels, heads, weights = setup()
    parts, grads, _ = loss_and_grads(params, eps, labels, heads, weights, alpha, eta)
    gen = TorchGenerator(params)
    gen.train()
    loss = torch_loss(gen, eps, labels, heads, weights, alpha, eta)
    loss.backward()
    assert parts["loss"] == pytest.approx(loss.item(), rel=1e-13, abs=1e-15)
    assert parts["loss"] == pytest.approx(alpha * parts["teacher"] + eta * parts["diversity"], rel=1e-15)
    named = dict(gen.named_parameters())
    assert set(grads) == set(TRAINED) == set(named)
    for name in TRAINED:
        ref = named[name].grad
        assert ref is not None
        np.testing.assert_allclose(grads[name], ref.numpy(), rtol=1e-9, atol=1e-14, err_msg=name)


def test_gradients_match_central_finite_differences_in_float64() -> None:
    params, eps, labels, heads, weights = setup(3)
    _, grads, _ = loss_and_grads(params, eps, labels, heads, weights, 1.0, 1.0)
    rng = np.random.default_rng(11)
    h = 1e-6
    for name in TRAINED:
        for flat in rng.choice(params[name].size, size=3, replace=False):
            idx = np.unravel_index(flat, params[name].shape)
            plus = {k: v.copy() for k, v in params.items()}
            minus = {k: v.copy() for k, v in params.items()}
            plus[name][idx] += h
            minus[name][idx] -= h
            up = loss_and_grads(plus, eps, labels, heads, weights, 1.0, 1.0)[0]["loss"]
            down = loss_and_grads(minus, eps, labels, heads, weights, 1.0, 1.0)[0]["loss"]
            assert grads[name][idx] == pytest.approx((up - down) / (2 * h), rel=1e-5, abs=1e-8), (name, idx)


def test_adam_with_l2_weight_decay_matches_torch_over_several_steps() -> None:
    params, eps, labels, heads, weights = setup(5)
    gen = TorchGenerator(params)
    gen.train()
    opt = torch.optim.Adam(gen.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    adam = Adam(3e-3, 1e-2)
    m = {n: np.zeros_like(params[n]) for n in TRAINED}
    v = {n: np.zeros_like(params[n]) for n in TRAINED}
    for step in range(4):
        e = np.random.default_rng(step).random((B, NOISE))
        _, grads, f = loss_and_grads(params, e, labels, heads, weights, 1.0, 1.0)
        update_running(params, f)
        adam.step(params, grads, m, v)
        opt.zero_grad()
        torch_loss(gen, e, labels, heads, weights, 1.0, 1.0).backward()
        opt.step()
    state = gen.state_dict()
    for name in (*TRAINED, "bn.running_mean", "bn.running_var"):
        np.testing.assert_allclose(params[name], state[name].numpy(), rtol=1e-9, atol=1e-13, err_msg=name)
    # And the eval-mode pass (running statistics), as the clients run it.
    gen.eval()
    with torch.no_grad():
        ref = gen(torch.tensor(eps), torch.tensor(labels)).numpy()
    np.testing.assert_allclose(eval_forward(params, eps, labels, K), ref, rtol=1e-12, atol=1e-13)


def test_the_training_pass_normalises_with_the_biased_batch_variance() -> None:
    params, eps, labels, _, _ = setup()
    f = forward(params, eps, labels, K)
    assert np.allclose(f.x_hat.mean(axis=0), 0, atol=1e-12) and np.allclose((f.x_hat ** 2).mean(axis=0),
                                                                           f.var / (f.var + 1e-5))
    assert np.array_equal(f.x[:, NOISE:], np.eye(K)[labels]) and np.array_equal(f.x[:, :NOISE], eps)


def test_label_weights_by_hand() -> None:
    # Counts of two organizations over 3 labels; each count starts at 1 (userpFedGen.py:29-31).
    weights, qualified = label_weights(np.array([[3, 0, 1], [0, 0, 2]]))
    # Smoothed: [4, 1, 2] and [1, 1, 3]: w[y] = c̃_k[y] / Σ_j c̃_j[y].
    np.testing.assert_array_equal(weights, [[4 / 5, 1 / 5], [1 / 2, 1 / 2], [2 / 5, 3 / 5]])
    assert qualified.tolist() == [0, 2]  # label 1: nobody counted it (max c̃ = 1)


def test_teacher_and_diversity_losses_by_hand() -> None:
    # One head of zeros: every logit 0, CE = log K for any label, weight 1.
    g = np.array([[0.0, 1.0], [2.0, -1.0]])
    loss, grad = teacher_loss(g, np.array([0, 1]), [(np.zeros((3, 2)), np.zeros(3))], np.ones((2, 1)))
    assert loss == pytest.approx(math.log(3), rel=1e-15) and np.array_equal(grad, np.zeros_like(g))
    # Half weight on the second example: (log 3 + log 3 / 2) / 2.
    loss, _ = teacher_loss(g, np.array([0, 1]), [(np.zeros((3, 2)), np.zeros(3))], np.array([[1.0], [0.5]]))
    assert loss == pytest.approx(0.75 * math.log(3), rel=1e-15)
    # B = 2, d = 1: N_01 = 1, D_01 = 2, mean over the 4 pairs of N·D = (0 + 2 + 2 + 0)/4 = 1: exp(−1).
    loss, grad = diversity_loss(np.array([[0.0], [1.0]]), np.array([[0.0], [2.0]]))
    assert loss == pytest.approx(math.exp(-1), rel=1e-15)
    # ∂/∂g_0 = −e^{−1}·(1/4)·(N_01·sign(g_0 − g_1) + N_10·sign(g_0 − g_1)) = e^{−1}/2; ∂/∂g_1 = −e^{−1}/2.
    np.testing.assert_allclose(grad, [[math.exp(-1) / 2], [-math.exp(-1) / 2]], rtol=1e-15)
