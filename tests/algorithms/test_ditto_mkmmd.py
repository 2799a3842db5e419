"""MK-MMD (§3.3): its estimates and covariance against float64 loops, the kernel-weight QP, refits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize
from torch.nn import functional as F

from hetfed.client.algorithms.ditto import kernels, mkmmd
from hetfed.client.algorithms.ditto.kernels import paper_gammas
from hetfed.client.algorithms.ditto.mkmmd import (
    KernelQpError,
    MkMmdLoss,
    block_pivoting_qp,
    choose_kernel_weights,
    mkmmd_covariance,
    mkmmd_estimates,
    mkmmd_statistics,
    nonnegative_qp,
    pair_statistics,
    solve_kernel_qp,
)


def _k(a: np.ndarray, b: np.ndarray, gamma: float, form: str) -> float:
    sq = float(((a - b) ** 2).sum())
    return math.exp(-gamma * sq) if form == "rate" else math.exp(-sq / gamma)


def _pair_h(x: np.ndarray, y: np.ndarray, gamma: float, form: str) -> np.ndarray:
    n = x.shape[0]
    h = np.zeros((n, n))
    for i in range(n):
        for k in range(n):
            h[i, k] = (_k(x[i], x[k], gamma, form) + _k(y[i], y[k], gamma, form)
                       - _k(x[i], y[k], gamma, form) - _k(x[k], y[i], gamma, form))
    return h


def _loop_estimates_and_cov(x: np.ndarray, y: np.ndarray, gammas: list[float], form: str,
                            estimator: str) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    pairs = [(i, k) for i in range(n) for k in range(n) if estimator == "biased" or i != k]
    hs = [_pair_h(x, y, g, form) for g in gammas]
    per_pair = np.array([[h[i, k] for (i, k) in pairs] for h in hs])
    d_hat = per_pair.mean(axis=1)
    return d_hat, np.cov(per_pair, ddof=1)


def _rows(seed: int, n: int, dim: int, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g, dtype=torch.float64) + shift


def _random_qp_case(rng: np.random.Generator, case: int) -> tuple[np.ndarray, np.ndarray]:
    if case % 2 == 0:  # Q̂ and d̂ from real features at a random shift and width
        n, dim = int(rng.integers(6, 14)), int(rng.integers(2, 8))
        x = torch.from_numpy(rng.normal(size=(n, dim)))
        y = torch.from_numpy(rng.normal(size=(n, dim)) * rng.uniform(0.5, 2.0) + rng.uniform(0.0, 1.0))
        d_hat, q_hat = MkMmdLoss(normalize_features=bool(case % 4)).statistics(x, y)
        d, q = d_hat.numpy(), q_hat.numpy()
        if not (d > 0).any():
            d = np.abs(d)
        return d, q
    k = 19
    basis = rng.normal(size=(k, int(rng.integers(1, 25))))
    q = basis @ basis.T * 10.0 ** rng.uniform(-5, 0)  # PSD, often rank-deficient, of varied scale
    d = rng.normal(size=k) * 10.0 ** rng.uniform(-4, 0)
    d[int(rng.integers(k))] = abs(d[int(rng.integers(k))]) + 1e-3  # at least one positive entry
    return d, q


@pytest.mark.parametrize("form", ["rate", "scale"])
def test_mkmmd_estimates_by_hand_on_two_points(form: str) -> None:
    # x = {0, 1}, y = {3, 5} on a line; squared distances xx' = 1, yy' = 4, x0y1 = 25, x1y0 = 4, x0y0 = 9, x1y1 = 16.
    x = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    y = torch.tensor([[3.0], [5.0]], dtype=torch.float64)
    gammas = torch.tensor([0.5, 2.0], dtype=torch.float64)

    def k(sq: float, g: float) -> float:
        return math.exp(-g * sq) if form == "rate" else math.exp(-sq / g)

    h = pair_statistics(x, y, gammas, form)
    for j, g in enumerate(gammas.tolist()):
        off = k(1, g) + k(4, g) - k(25, g) - k(4, g)  # h(0,1) = h(1,0)
        diag0, diag1 = 2 - 2 * k(9, g), 2 - 2 * k(16, g)
        assert float(h[j, 0, 1]) == pytest.approx(off, rel=1e-14, abs=1e-15)
        assert float(h[j, 1, 0]) == pytest.approx(off, rel=1e-14, abs=1e-15)
        assert float(mkmmd_estimates(h, "unbiased")[j]) == pytest.approx(off, rel=1e-14, abs=1e-15)
        want_biased = (2 * off + diag0 + diag1) / 4
        assert float(mkmmd_estimates(h, "biased")[j]) == pytest.approx(want_biased, rel=1e-14, abs=1e-15)


@pytest.mark.parametrize(("estimator", "form"), [("unbiased", "rate"), ("biased", "scale")])
def test_mkmmd_estimates_and_covariance_match_a_float64_loop(estimator: str, form: str) -> None:
    x = _rows(1, 6, 3)
    y = _rows(2, 6, 3, shift=0.4)
    gammas = [0.25, 1.0, 3.0]
    want_d, want_q = _loop_estimates_and_cov(x.numpy(), y.numpy(), gammas, form, estimator)
    h = pair_statistics(x, y, torch.tensor(gammas, dtype=torch.float64), form)
    d_hat = mkmmd_estimates(h, estimator)
    q_hat = mkmmd_covariance(h, d_hat, estimator)
    np.testing.assert_allclose(d_hat.numpy(), want_d, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(q_hat.numpy(), want_q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("estimator", ["unbiased", "biased"])
@pytest.mark.parametrize("form", ["rate", "scale"])
def test_mkmmd_statistics_half_pairs_match_the_float64_loop(estimator: str, form: str) -> None:
    # The refit's path (half the pairs, chunked, merged) gives the full-tensor loop's d̂ and Q̂.
    x = _rows(1, 6, 3)
    y = _rows(2, 6, 3, shift=0.4)
    gammas = [0.25, 1.0, 3.0]
    want_d, want_q = _loop_estimates_and_cov(x.numpy(), y.numpy(), gammas, form, estimator)
    d_hat, q_hat = mkmmd_statistics(x, y, torch.tensor(gammas, dtype=torch.float64), form, estimator)
    np.testing.assert_allclose(d_hat.numpy(), want_d, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(q_hat.numpy(), want_q, rtol=1e-12, atol=1e-14)


def test_mkmmd_statistics_chunks_merge_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 4 pairs over 15 (and the squaring path on the paper's grid) give the one-chunk figures.
    x, y = _rows(5, 6, 3), _rows(6, 6, 3, shift=0.2)
    whole = mkmmd_statistics(x, y, paper_gammas(), "rate", "biased")
    monkeypatch.setattr(mkmmd, "_STATISTICS_CHUNK", 4)
    monkeypatch.setattr(kernels, "_SQUARING_MIN_ELEMENTS", 1)
    parts = mkmmd_statistics(x, y, paper_gammas(), "rate", "biased")
    np.testing.assert_allclose(parts[0].numpy(), whole[0].numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(parts[1].numpy(), whole[1].numpy(), rtol=1e-11, atol=1e-15)


def test_mkmmd_module_normalises_rows_and_weights_kernels_by_beta() -> None:
    x = _rows(3, 5, 4).float()  # float32 in, float32 out; the maths runs in float64
    y = _rows(4, 5, 4, shift=0.3).float()
    loss = MkMmdLoss(normalize_features=True)
    beta = torch.linspace(1.0, 2.0, 19, dtype=torch.float64)
    loss.beta.copy_(beta / beta.sum())
    xn = F.normalize(x.double(), dim=1).numpy()
    yn = F.normalize(y.double(), dim=1).numpy()
    want_d, _ = _loop_estimates_and_cov(xn, yn, paper_gammas().tolist(), "rate", "unbiased")
    got = loss(x, y)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(float((loss.beta.numpy() * want_d).sum()), rel=1e-6)
    np.testing.assert_allclose(loss.per_kernel(x, y).detach().numpy(), want_d, rtol=1e-12, atol=1e-14)
    # without normalisation the raw rows are used
    raw = MkMmdLoss(normalize_features=False)
    want_raw, _ = _loop_estimates_and_cov(x.double().numpy(), y.double().numpy(), paper_gammas().tolist(),
                                          "rate", "unbiased")
    np.testing.assert_allclose(raw.per_kernel(x, y).detach().numpy(), want_raw, rtol=1e-12, atol=1e-14)


def test_mkmmd_rejects_unequal_samples_and_bad_options() -> None:
    loss = MkMmdLoss()
    with pytest.raises(ValueError, match="same size"):
        loss(torch.zeros(4, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="at least 2 rows"):
        loss(torch.zeros(1, 3), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="bandwidth_form"):
        MkMmdLoss(bandwidth_form="width")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="estimator"):
        MkMmdLoss(estimator="linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gammas"):
        MkMmdLoss(gammas=[1.0, -2.0])
    with pytest.raises(ValueError, match="epsilon"):
        MkMmdLoss(epsilon=0.0)


def test_qp_by_hand_isotropic_diagonal_and_active_constraint() -> None:
    eps = 1e-3
    # Q̂ = 0: min ε‖β‖² on d̂ᵀβ = 1 gives β = d̂/‖d̂‖².
    np.testing.assert_allclose(solve_kernel_qp(np.array([1.0, 2.0]), np.zeros((2, 2)), eps), [0.2, 0.4],
                               rtol=1e-12)
    # Q̂ + εI = diag(1, 3), d̂ = (1, 1): β ∝ (1, 1/3), scaled to d̂ᵀβ = 1.
    q = np.diag([1.0 - eps, 3.0 - eps])
    np.testing.assert_allclose(solve_kernel_qp(np.ones(2), q, eps), [0.75, 0.25], rtol=1e-12)
    # Strongly correlated kernels: the unconstrained optimum ∝ A⁻¹d̂ = (0.55, −0.4)/0.19 is infeasible,
    # the QP puts all weight on kernel 0 (KKT: 2Aβ = (2, 1.8) = 2·d̂ + (0, 0.8), multiplier 0.8 ≥ 0).
    q = np.array([[1.0, 0.9], [0.9, 1.0]]) - eps * np.eye(2)
    np.testing.assert_allclose(solve_kernel_qp(np.array([1.0, 0.5]), q, eps), [1.0, 0.0], atol=1e-14)
    # A negative d̂_j only lowers the constraint: d̂ = (1, −1), Q̂ = 0 gives β = (1, 0).
    np.testing.assert_allclose(solve_kernel_qp(np.array([1.0, -1.0]), np.zeros((2, 2)), eps), [1.0, 0.0],
                               atol=1e-14)


def test_qp_matches_a_general_solver_on_random_cases() -> None:
    rng = np.random.default_rng(20240611)
    eps = 1e-3
    for case in range(24):
        d, q = _random_qp_case(rng, case)
        a = q + eps * np.eye(d.size)
        beta = solve_kernel_qp(d, q, eps)
        # constraints
        assert beta.min() >= 0.0
        assert float(d @ beta) == pytest.approx(1.0, abs=1e-9)
        # a general solver (SLSQP) on the same problem rescaled to order one (β = b/s, s = max d̂_j)
        s = float(d.max())
        a1 = a / float(np.abs(a).max())

        def fun(b: np.ndarray, a1: np.ndarray = a1) -> float:
            return float(b @ a1 @ b)

        def jac(b: np.ndarray, a1: np.ndarray = a1) -> np.ndarray:
            return 2.0 * a1 @ b

        d1 = d / s
        cons = [{"type": "eq", "fun": lambda b, d1=d1: d1 @ b - 1.0, "jac": lambda b, d1=d1: d1}]
        start = np.where(d1 > 0, 1.0, 0.0)
        start = start / float(d1 @ start)
        ref = optimize.minimize(fun, start, jac=jac, bounds=[(0.0, None)] * d.size, constraints=cons,
                                method="SLSQP", options={"ftol": 1e-15, "maxiter": 2000})
        ref_beta = ref.x / s
        # SLSQP may stop with "positive directional derivative" at machine precision; its point must be feasible
        assert ref.success or ref.status == 8, ref.message
        assert abs(float(d @ ref_beta) - 1.0) < 1e-6 and ref_beta.min() > -1e-6 * float(np.abs(ref_beta).max())

        def objective(b: np.ndarray, a: np.ndarray = a) -> float:
            return float(b @ a @ b)

        # ours is at least as good as the general solver's point, and the two objectives agree within 1e-6
        ours, theirs = objective(beta), objective(ref_beta)
        assert ours <= theirs + 1e-9 * max(1.0, abs(theirs))
        assert abs(ours - theirs) <= 1e-6 * max(1.0, abs(theirs)), (case, ours, theirs)
        # and our point satisfies the KKT conditions: 2Aβ − νd̂ = μ ≥ 0 with μ = 0 where β > 0
        g = 2.0 * a @ beta
        nu = float(g @ beta)  # since d̂ᵀβ = 1 and μᵀβ = 0
        mu = g - nu * d
        scale = max(1.0, float(np.abs(g).max()))
        assert mu.min() >= -1e-8 * scale
        assert float(np.abs(mu[beta > 1e-12]).max(initial=0.0)) <= 1e-8 * scale


def test_a_warm_start_gives_the_cold_starts_solution() -> None:
    rng = np.random.default_rng(7)
    eps = 1e-3
    for case in range(24):
        d, q = _random_qp_case(rng, case)
        cold = solve_kernel_qp(d, q, eps)
        for warm in (cold > 0, np.ones(d.size, bool), rng.random(d.size) < 0.5, np.zeros(d.size, bool)):
            np.testing.assert_allclose(solve_kernel_qp(d, q, eps, warm=warm), cold, rtol=1e-9, atol=1e-12)


def test_refit_and_forward_is_refit_then_forward() -> None:
    torch.manual_seed(4)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 5, dtype=torch.float64)
    one, two = MkMmdLoss(), MkMmdLoss()
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    one.refit(xa.detach(), y)
    separate = one(xa, y)
    fused = two.refit_and_forward(xb, y)
    assert torch.equal(one.beta, two.beta) and one.last_refit == two.last_refit
    assert torch.equal(separate, fused)
    separate.backward()
    fused.backward()
    assert xa.grad is not None and xb.grad is not None and torch.equal(xa.grad, xb.grad)


@pytest.mark.parametrize(("estimator", "form", "tied"),
                         [("unbiased", "rate", False), ("biased", "scale", False), ("biased", "rate", True),
                          ("unbiased", "scale", True)])
def test_per_step_path_matches_the_float64_loop_and_the_pair_statistics_gradient(estimator: str, form: str,
                                                                               tied: bool) -> None:
    # The per-batch path (one distance matrix and one kernel stack over [x; y], weights per block, a written-out
    # backward) gives the loop's d̂, the QP's β on the loop's d̂ and Q̂, and the gradient of the per-block pair
    # statistics by autograd, also with tied rows (distances clamped at 0).
    x, y = _rows(21, 7, 3), _rows(22, 7, 3, shift=0.3)
    if tied:
        x[4] = x[1]
        y[2] = x[1]
    gammas = paper_gammas()
    loss = MkMmdLoss(normalize_features=False, bandwidth_form=form, estimator=estimator)  # type: ignore[arg-type]
    want_d, want_q = _loop_estimates_and_cov(x.numpy(), y.numpy(), gammas.tolist(), form, estimator)
    np.testing.assert_allclose(loss.per_kernel(x, y).detach().numpy(), want_d, rtol=1e-12, atol=1e-14)
    xa = x.clone().requires_grad_(True)
    value = loss.refit_and_forward(xa, y)
    want_beta, how = choose_kernel_weights(want_d, want_q, np.full(19, 1 / 19))
    assert loss.last_refit == how
    np.testing.assert_allclose(loss.beta.numpy(), want_beta, rtol=1e-10, atol=1e-13)
    assert float(value.detach()) == pytest.approx(float((want_beta * want_d).sum()), rel=1e-10, abs=1e-15)
    xb = x.clone().requires_grad_(True)
    old = (loss.beta * mkmmd_estimates(pair_statistics(xb, y, gammas, form), estimator)).sum()  # type: ignore[arg-type]
    value.backward()
    old.backward()
    assert xa.grad is not None and xb.grad is not None
    np.testing.assert_allclose(xa.grad.numpy(), xb.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_block_pivoting_gives_the_active_set_solution() -> None:
    # The fast solver settles on every random case (real-feature Q̂ and rank-deficient ones, cold and warm)
    # at the one-index active set's point.
    rng = np.random.default_rng(11)
    for case in range(200):
        d, q = _random_qp_case(rng, case)
        a = 0.5 * (q + q.T) + 1e-3 * np.eye(d.size)
        b = d / d.max()
        want = nonnegative_qp(a, b)
        for warm in (None, want > 0, rng.random(d.size) < 0.5, np.ones(d.size, bool)):
            got = block_pivoting_qp(a, b, warm=warm)
            assert got is not None
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_nonnegative_qp_solves_the_bound_constrained_problem() -> None:
    a = np.array([[2.0, 1.0], [1.0, 2.0]])
    np.testing.assert_allclose(nonnegative_qp(a, np.array([1.0, 1.0])), [1 / 3, 1 / 3], rtol=1e-14)
    np.testing.assert_allclose(nonnegative_qp(a, np.array([1.0, -1.0])), [0.5, 0.0], rtol=1e-14)
    np.testing.assert_allclose(nonnegative_qp(a, np.array([-1.0, -1.0])), [0.0, 0.0])
    with pytest.raises(KernelQpError, match="non-finite"):
        nonnegative_qp(a, np.array([np.nan, 1.0]))


def test_fallback_single_kernel_when_no_estimate_is_positive() -> None:
    d = np.array([-1.0, -0.5, -0.2])
    q = np.diag([4.0, 0.25, 1e-4])
    # d̂_j/sqrt(Q̂_jj + ε): −0.49994, −0.99800, −6.0302: kernel 0 (argmax d̂ alone would pick kernel 2)
    beta, how = choose_kernel_weights(d, q, np.full(3, 1 / 3), 1e-3)
    assert how == "single_kernel"
    np.testing.assert_array_equal(beta, [1.0, 0.0, 0.0])
    with pytest.raises(KernelQpError, match="no d̂_j is positive"):
        solve_kernel_qp(d, q)


def test_fallback_keeps_previous_beta_when_the_qp_fails() -> None:
    prev = np.array([0.2, 0.3, 0.5])
    d = np.array([1.0, 0.5, 0.1])
    beta, how = choose_kernel_weights(d, np.full((3, 3), np.nan), prev)
    assert how == "kept"
    np.testing.assert_array_equal(beta, prev)
    not_psd = -np.eye(3)  # Q̂ + εI is not positive definite: the QP refuses
    beta, how = choose_kernel_weights(d, not_psd, prev)
    assert how == "kept"
    np.testing.assert_array_equal(beta, prev)
    beta, how = choose_kernel_weights(d, np.zeros((3, 3)), prev)
    assert how == "qp" and beta.sum() == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_allclose(beta, d / d.sum(), rtol=1e-12)  # Q̂ = 0: β ∝ d̂, then normalised to Σβ = 1


def test_refit_outcomes_on_the_module() -> None:
    loss = MkMmdLoss()
    x = _rows(5, 8, 4)
    assert loss.refit(x, x.clone()) == "single_kernel"  # identical samples: every d̂_j is 0
    assert float(loss.beta.sum()) == 1.0 and int((loss.beta > 0).sum()) == 1
    y = _rows(6, 8, 4, shift=1.0)
    assert loss.refit(x, y) == "qp"
    assert loss.last_refit == "qp"
    assert float(loss.beta.sum()) == pytest.approx(1.0, abs=1e-12) and float(loss.beta.min()) >= 0.0
    before = loss.beta.clone()
    bad = y.clone()
    bad[0, 0] = float("nan")
    assert loss.refit(x, bad) == "kept"
    assert torch.equal(loss.beta, before)
    # β persists through state_dict
    other = MkMmdLoss()
    other.load_state_dict(loss.state_dict())
    assert torch.equal(other.beta, before)


def test_fl4health_qp_form_on_a_diagonal_three_kernel_case_by_hand() -> None:
    # Diagonal Q̂ = diag(0.1, 0.2, 0.4), d̂ = (1, 2, 1): min βᵀAβ with d̂ᵀβ = 1 gives β_j ∝ d_j/A_jj, then Σβ = 1.
    d = np.array([1.0, 2.0, 1.0])
    q = np.diag([0.1, 0.2, 0.4])
    uniform = np.full(3, 1.0 / 3.0)
    for form, diag in (("paper", [0.1 + 1e-3, 0.2 + 1e-3, 0.4 + 1e-3]),
                       ("fl4health", [0.2 + 1e-5, 0.4 + 1e-5, 0.8 + 1e-5])):  # 2Q̂ + 1e-5·I
        raw = [d[j] / diag[j] for j in range(3)]
        want = [r / sum(raw) for r in raw]
        beta, how = choose_kernel_weights(d, q, uniform, 1e-3, form)  # type: ignore[arg-type]
        assert how == "qp"
        np.testing.assert_allclose(beta, want, rtol=1e-12, atol=0)


def test_fl4health_fallback_divides_by_the_shifted_variance_without_a_root() -> None:
    # No d̂_j > 0: the paper picks argmax d_j/sqrt(Q_jj + ε), the reference code argmax d_j/(2Q_jj + 1e-5).
    d = np.array([-0.1, -0.2, -0.4])
    q = np.diag([0.01, 0.1, 1.0])
    # paper: -0.1/0.1049 = -0.953, -0.2/0.3178 = -0.629, -0.4/1.0005 = -0.3998 -> kernel 2
    # fl4health: -0.1/0.02001 = -4.998, -0.2/0.20001 = -1.0, -0.4/2.00001 = -0.2 -> kernel 2 as well; make it differ:
    q2 = np.diag([0.0004, 0.1, 1.0])
    # paper: -0.1/sqrt(0.0014) = -2.673, -0.629, -0.3998 -> 2; fl4health: -0.1/0.00081 = -123, -1.0, -0.2 -> 2
    d2 = np.array([-0.001, -0.2, -0.4])
    # paper: -0.001/0.03742 = -0.0267 -> 0; fl4health: -0.001/0.00081 = -1.2346, -1.0, -0.2 -> 2
    for dd, qq, want_paper, want_ref in ((d, q, 2, 2), (d2, q2, 0, 2)):
        beta_p, how_p = choose_kernel_weights(dd, qq, np.full(3, 1 / 3), 1e-3, "paper")
        beta_r, how_r = choose_kernel_weights(dd, qq, np.full(3, 1 / 3), 1e-3, "fl4health")
        assert how_p == how_r == "single_kernel"
        assert int(np.argmax(beta_p)) == want_paper and int(np.argmax(beta_r)) == want_ref


def test_beta_random_start_is_the_seeded_uniform_draw_normalised() -> None:
    gammas = [0.5, 1.0, 2.0]
    u = torch.rand(3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    loss = MkMmdLoss(gammas, beta_init="random", seed=7)
    want = [float(v) / float(u.sum()) for v in u]
    np.testing.assert_allclose(loss.beta.numpy(), want, rtol=1e-15, atol=0)
    assert float(loss.beta.sum()) == pytest.approx(1.0, rel=1e-15)
    np.testing.assert_array_equal(MkMmdLoss(gammas).beta.numpy(), np.full(3, 1.0 / 3.0))
    assert torch.equal(MkMmdLoss(gammas, beta_init="random", seed=7).beta, loss.beta)
    assert not torch.equal(MkMmdLoss(gammas, beta_init="random", seed=8).beta, loss.beta)
    with pytest.raises(ValueError, match="beta_init"):
        MkMmdLoss(gammas, beta_init="ones")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="qp_form"):
        MkMmdLoss(gammas, qp_form="cvxpy")  # type: ignore[arg-type]
