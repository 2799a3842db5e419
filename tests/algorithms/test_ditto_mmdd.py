"""MMD-D (§3.4): the deep-kernel estimate and variance against float64 loops, its training, its options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hetfed.client.algorithms.ditto.kernels import squared_distances
from hetfed.client.algorithms.ditto.mmdd import MmdDLoss, mmd2_unbiased, mmd2_variance


def _rows(seed: int, n: int, dim: int, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g, dtype=torch.float64) + shift


def _loop_mmd_and_var(kxx: np.ndarray, kyy: np.ndarray, kxy: np.ndarray) -> tuple[float, float]:
    n = kxx.shape[0]
    h = [[kxx[i, j] + kyy[i, j] - kxy[i, j] - kxy[j, i] for j in range(n)] for i in range(n)]
    mmd = sum(h[i][j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    rows = [sum(h[i]) for i in range(n)]
    total = sum(rows)
    var = 4.0 / n**3 * sum(r * r for r in rows) - 4.0 / n**4 * total**2 + 1e-8
    return mmd, var


def test_mmd_estimate_and_variance_by_hand_on_two_points() -> None:
    kxx = torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    kyy = torch.tensor([[1.0, 0.25], [0.25, 1.0]], dtype=torch.float64)
    kxy = torch.tensor([[0.5, 0.125], [0.0, 0.5]], dtype=torch.float64)
    # H = [[1, 0.625], [0.625, 1]]: MMD²_u = (0.625 + 0.625)/2; rows 1.625 each, total 3.25
    assert float(mmd2_unbiased(kxx, kyy, kxy)) == 0.625
    want_var = 4 / 8 * (2 * 1.625**2) - 4 / 16 * 3.25**2 + 1e-8
    assert float(mmd2_variance(kxx, kyy, kxy)) == pytest.approx(want_var, rel=1e-15, abs=1e-18)


@pytest.mark.parametrize("form", ["paper", "liu"])
def test_mmdd_kernel_estimate_and_variance_match_a_float64_loop(form: str) -> None:
    loss = MmdDLoss(3, kernel_form=form, sigma_phi_init=0.5, sigma_q_init=4.0, epsilon_init=0.2, seed=3)
    x = _rows(7, 6, 3)
    y = _rows(8, 6, 3, shift=0.5)
    kxx, kyy, kxy = loss.kernel_matrices(x, y)
    # the kernel itself, row by row
    with torch.no_grad():
        phi = loss.featurizer(torch.cat([x, y])).numpy()
    z = torch.cat([x, y]).numpy()
    eps, (s_phi, s_q) = loss.epsilon, loss.sigmas
    assert eps == pytest.approx(0.2, rel=1e-12) and s_phi == pytest.approx(0.5) and s_q == pytest.approx(4.0)

    def kw(a: int, b: int) -> float:
        deep = math.exp(-float(((phi[a] - phi[b]) ** 2).sum()) / s_phi)
        q = math.exp(-float(((z[a] - z[b]) ** 2).sum()) / s_q)
        return (1 - eps) * deep + eps * q if form == "paper" else ((1 - eps) * deep + eps) * q

    full = np.array([[kw(a, b) for b in range(12)] for a in range(12)])
    np.testing.assert_allclose(kxx.numpy(), full[:6, :6], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(kyy.numpy(), full[6:, 6:], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(kxy.numpy(), full[:6, 6:], rtol=1e-12, atol=1e-15)
    want_mmd, want_var = _loop_mmd_and_var(full[:6, :6], full[6:, 6:], full[:6, 6:])
    assert float(loss(x, y)) == pytest.approx(want_mmd, rel=1e-12, abs=1e-15)
    mmd2, var = (v.detach() for v in loss.objective(x, y))
    assert float(mmd2) == pytest.approx(want_mmd, rel=1e-12, abs=1e-15)
    assert float(var) == pytest.approx(want_var, rel=1e-12, abs=1e-15)


def assert_criterion_is_the_objective(loss: MmdDLoss, x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor) -> None:
    """The refit's criterion equals MMD²_u/σ̂ of (x, y[perm]) from the full matrices: value and gradient."""
    mmd2, var = loss.objective(x, y[perm])
    want = mmd2 / torch.sqrt(var.clamp_min(1e-8))
    z = torch.cat([x, y])
    got = loss.shuffled_criterion(z, squared_distances(z, z), perm)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    params = list(loss.parameters())
    for a, b in zip(torch.autograd.grad(want, params), torch.autograd.grad(got, params), strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("form", ["paper", "liu"])
def test_mmdd_shuffled_criterion_is_the_objective_on_the_shuffled_pairs(form: str) -> None:
    # The refit's criterion (row sums, no permuted matrices) equals MMD²_u/σ̂ of (x, y[perm]), value and gradient.
    loss = MmdDLoss(3, kernel_form=form, sigma_phi_init=0.5, sigma_q_init=4.0, epsilon_init=0.2, seed=3)
    x, y = _rows(7, 6, 3), _rows(8, 6, 3, shift=0.5)
    perm = torch.tensor([2, 0, 5, 1, 4, 3])
    assert_criterion_is_the_objective(loss, x, y, perm)


@pytest.mark.parametrize("form", ["paper", "liu"])
def test_mmdd_criterion_gradient_matches_autograd_with_tied_rows(form: str) -> None:
    # The written-out backward of the block row sums against autograd through the full matrices, with two
    # identical rows (a distance clamped at 0) and a non-trivial ε.
    loss = MmdDLoss(4, kernel_form=form, sigma_phi_init=0.3, sigma_q_init=2.0, epsilon_init=0.1, seed=5)
    x, y = _rows(13, 9, 4), _rows(14, 9, 4, shift=0.3)
    x[3] = x[1]
    y[2] = x[1]
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(2))
    assert_criterion_is_the_objective(loss, x, y, perm)


@pytest.mark.parametrize("form", ["paper", "liu"])
def test_mmdd_training_follows_autograd_through_the_full_matrices(form: str) -> None:
    # Five AdamW steps of train_kernel give the kernel that five steps of AdamW on −MMD²_u/σ̂ of (x, y[perm]),
    # built from the full matrices by autograd (objective), give with the same shuffles.
    fast = MmdDLoss(4, kernel_form=form, sigma_phi_init=0.5, sigma_q_init=3.0, epsilon_init=0.05, seed=8)
    slow = MmdDLoss(4, kernel_form=form, sigma_phi_init=0.5, sigma_q_init=3.0, epsilon_init=0.05, seed=8)
    x, y = _rows(15, 12, 4), _rows(16, 12, 4, shift=0.4)
    got = fast.train_kernel(x, y, steps=5)
    rng = torch.Generator().manual_seed(8)
    want = []
    for _ in range(5):
        perm = torch.randperm(12, generator=rng)
        slow.optimizer.zero_grad(set_to_none=True)
        mmd2, var = slow.objective(x, y[perm])
        criterion = mmd2 / torch.sqrt(var.clamp_min(1e-8))
        want.append(float(criterion.detach()))
        (-criterion).backward()
        slow.optimizer.step()
    np.testing.assert_allclose(got, want, rtol=1e-9)
    for (name, a), b in zip(slow.state_dict().items(), fast.state_dict().values(), strict=True):
        # φ's last bias shifts every φ row alike, which no distance sees: its gradient is 0 up to rounding, and
        # AdamW's normalised step turns that rounding into steps of 1e-8 (the former autograd path did as much).
        tol = 1e-7 if name == "featurizer.6.bias" else 1e-12
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-10, atol=tol, err_msg=name)


def test_mmdd_training_moves_the_kernel_and_its_state_persists() -> None:
    loss = MmdDLoss(4, sigma_phi_init=1.0, seed=0)
    x = _rows(9, 40, 4)
    y = _rows(10, 40, 4, shift=0.8)
    before = {k: v.clone() for k, v in loss.state_dict().items()}
    values = loss.train_kernel(x, y, steps=40)
    assert len(values) == 40 and all(math.isfinite(v) for v in values)
    assert values[-1] > values[0]  # ascent on MMD²/σ̂
    after = loss.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in loss.parameters())  # training leaves no stale gradients
    clone = MmdDLoss(4, sigma_phi_init=1.0, seed=123)
    clone.load_state_dict(after)
    assert float(clone(x, y)) == float(loss(x, y))
    assert loss.train_kernel(x, y, steps=0) == []


def test_mmdd_forward_sends_gradients_to_features_only() -> None:
    loss = MmdDLoss(4, sigma_phi_init=1.0)
    x = _rows(11, 8, 4).float().requires_grad_(True)
    y = _rows(12, 8, 4, shift=0.5).float()
    value = loss(x, y)
    assert value.dtype == torch.float32
    value.backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0
    assert all(p.grad is None for p in loss.parameters())


def test_mmdd_rejects_bad_options_and_unequal_samples() -> None:
    with pytest.raises(ValueError, match="kernel_form"):
        MmdDLoss(4, kernel_form="product")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epsilon_init"):
        MmdDLoss(4, epsilon_init=1.0)
    with pytest.raises(ValueError, match="train_steps"):
        MmdDLoss(4, train_steps=-1)
    with pytest.raises(ValueError, match="same size"):
        MmdDLoss(4)(torch.zeros(5, 4), torch.zeros(6, 4))
