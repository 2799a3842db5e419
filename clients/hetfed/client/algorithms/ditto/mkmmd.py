"""MK-MMD (§3.3): the multi-kernel MMD drift measure, its statistics, and the QP that chooses its kernel weights.

Paper: Ayromlou & Emerson, "Adaptive Latent-Space Constraints in Personalized FL" (shared/papers/001). Public
reference code, read for understanding only: VectorInstitute/FL4Health (fl4health/losses/mkmmd_loss.py). Where
the two differ, the paper's form is the default and the code's form is a named option. Kernel maths in float64
unless ``dtype`` says float32, the reference code's (:mod:`hetfed.client.algorithms.ditto.kernels`); the QP
always in float64 numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.ditto.kernels import (
    BANDWIDTH_FORMS,
    ESTIMATORS,
    KERNEL_DTYPE,
    BandwidthForm,
    MmdEstimator,
    as_feature_pair,
    check_choice,
    check_kernel_dtype,
    check_positive,
    doubling_period,
    paper_gammas,
    rbf,
    squared_distances,
)

MKMMD_QP_EPSILON = 1e-3
"""The paper's stabilising shift ε of Q̂ + εI (§3.3). The reference code uses 2·Q̂ + 1e-5·I in a ½zᵀQz QP."""
FL4HEALTH_QP_SHIFT = 1e-5
"""The reference code's shift: it solves min ½βᵀ(2Q̂ + 1e-5·I)β (mkmmd_loss.py, ``optimize_betas``'s lambda_m),
the same β as min βᵀ(Q̂ + 5e-6·I)β."""
RefitOutcome = Literal["qp", "single_kernel", "kept"]
QpForm = Literal["paper", "fl4health"]
BetaInit = Literal["uniform", "random"]
_QP_FORMS: tuple[str, ...] = ("paper", "fl4health")
_BETA_INITS: tuple[str, ...] = ("uniform", "random")


def pair_statistics(
    x: torch.Tensor, y: torch.Tensor, gammas: torch.Tensor, form: BandwidthForm = "rate"
) -> torch.Tensor:
    """h_j(i, k) = k_j(x_i, x_k) + k_j(y_i, y_k) − k_j(x_i, y_k) − k_j(x_k, y_i) for every kernel j: (d, n, n).

    ``form`` "rate" is the paper's k_j(a, b) = exp(−γ_j‖a − b‖²); "scale" is the reference code's
    exp(−‖a − b‖²/γ_j). x and y are same-size samples of rows (already in the dtype wanted).
    """
    check_choice("bandwidth_form", form, BANDWIDTH_FORMS)
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"pair_statistics needs two (n, features) samples of one shape, got {x.shape} and {y.shape}")
    kxx = rbf(squared_distances(x, x), gammas, form)
    kyy = rbf(squared_distances(y, y), gammas, form)
    kxy = rbf(squared_distances(x, y), gammas, form)
    return kxx + kyy - kxy - kxy.transpose(1, 2)


def mkmmd_estimates(h: torch.Tensor, estimator: MmdEstimator = "unbiased") -> torch.Tensor:
    """The per-kernel MMD² estimates d̂_j from the pair statistics h (d, n, n).

    "unbiased": the quadratic-time U-statistic, the mean of h over pairs i ≠ k (Gretton et al. 2012, MMD²_u).
    "biased": the reference code's mean over all n² pairs, diagonal included (the V-statistic, always ≥ 0).
    """
    check_choice("estimator", estimator, ESTIMATORS)
    n = h.shape[1]
    if estimator == "biased":
        return h.mean(dim=(1, 2))
    trace = torch.diagonal(h, dim1=1, dim2=2).sum(dim=1)
    return (h.sum(dim=(1, 2)) - trace) / (n * (n - 1))


def mkmmd_covariance(h: torch.Tensor, d_hat: torch.Tensor, estimator: MmdEstimator = "unbiased") -> torch.Tensor:
    """Q̂: the sample covariance (divisor N − 1) across kernels of the N per-pair statistics behind d̂.

    The pairs are those the estimator averages: i ≠ k for "unbiased" (N = n(n−1)), all n² for "biased" (the
    reference code's form, divisor n² − 1). This is the quadratic-time counterpart of Gretton et al.'s
    linear-time Q̂, which the paper reports performed poorly and does not use.
    """
    check_choice("estimator", estimator, ESTIMATORS)
    d, n, _ = h.shape
    flat = h.reshape(d, n * n)
    if estimator == "unbiased":
        off_diagonal = ~torch.eye(n, dtype=torch.bool, device=h.device).reshape(-1)
        flat = flat[:, off_diagonal]
    centred = flat - d_hat.reshape(d, 1)
    return (centred @ centred.transpose(0, 1)) / (flat.shape[1] - 1)


_STATISTICS_CHUNK = 8192
"""Pairs per chunk in :func:`mkmmd_statistics`: the (d, 4, chunk) kernel block stays in cache (about 5 MB)."""


@torch.no_grad()
def mkmmd_statistics(x: torch.Tensor, y: torch.Tensor, gammas: torch.Tensor, form: BandwidthForm = "rate",
                     estimator: MmdEstimator = "unbiased") -> tuple[torch.Tensor, torch.Tensor]:
    """(d̂, Q̂) of :func:`mkmmd_estimates` and :func:`mkmmd_covariance`, without gradients, from half the pairs.

    h_j(i, k) is symmetric in (i, k), so the pairs i < k carry every off-diagonal value twice; the diagonal
    counts for the biased estimator only. The pairs go in chunks whose mean and centred cross-products are
    merged exactly (Chan et al.'s pairwise update), so no (d, n, n) tensor is built: the refit on s = 50
    batches (500 rows) took 0.4 s with the full tensors (profiled).
    """
    check_choice("bandwidth_form", form, BANDWIDTH_FORMS)
    check_choice("estimator", estimator, ESTIMATORS)
    if x.shape != y.shape or x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"mkmmd_statistics needs two (n, features) samples of one shape, n >= 2, got {x.shape} "
                         f"and {y.shape}")
    n = x.shape[0]
    d = gammas.numel()
    i, k = torch.triu_indices(n, n, offset=1, device=x.device)
    dxx, dyy, dxy = squared_distances(x, x), squared_distances(y, y), squared_distances(x, y)
    upper = torch.stack([dxx[i, k], dyy[i, k], dxy[i, k], dxy[k, i]])  # (4, n(n−1)/2)
    # Kernels in ascending rate order (so that the squaring path fills whole groups), put back at the end.
    rates = gammas if form == "rate" else 1.0 / gammas
    order = torch.argsort(rates.detach().cpu()).to(gammas.device)
    sorted_gammas = gammas[order]
    period = doubling_period(rates)
    count = 0.0
    mean = x.new_zeros(d)
    m2 = x.new_zeros((d, d))

    def merge(h: torch.Tensor, w: float) -> None:
        # Chan et al.'s exact merge of a group of values (d, m), each counted w times, into (count, mean, m2)
        nonlocal count, mean, m2
        nb = w * h.shape[1]
        mb = h.mean(dim=1)
        c = h.sub_(mb.unsqueeze(1))
        delta = mb - mean
        total = count + nb
        m2 = m2 + w * (c @ c.transpose(0, 1)) + torch.outer(delta, delta) * (count * nb / total)
        mean = mean + delta * (nb / total)
        count = total

    # Each off-diagonal pair counts twice (h is symmetric); each chunk is merged while it is in cache.
    for start in range(0, upper.shape[1], _STATISTICS_CHUNK):
        merge(_pair_h(upper[:, start:start + _STATISTICS_CHUNK], sorted_gammas, form, period), 2.0)
    if estimator == "biased":  # k(x_i, x_i) = k(y_i, y_i) = 1, so h_j(i, i) = 2 − 2·k_j(x_i, y_i)
        merge(2.0 - 2.0 * rbf(dxy.diagonal().unsqueeze(0), sorted_gammas, form)[:, 0], 1.0)
    back = torch.argsort(order)
    return mean[back], (m2 / (count - 1))[back][:, back]


def _pair_h(upper: torch.Tensor, gammas: torch.Tensor, form: BandwidthForm, period: int) -> torch.Tensor:
    """h_j = k_j(d_xx) + k_j(d_yy) − k_j(d_xy) − k_j(d_yx) for the four distance rows of ``upper``: (d, m).

    ``gammas`` in ascending rate order; when the rates double every ``period`` kernels, only the first
    ``period`` call exp and each later group of kernels is the square of the group before it (in one op).
    """
    if period == 0:
        kern = rbf(upper, gammas, form)
    else:
        rates = gammas if form == "rate" else 1.0 / gammas
        d = gammas.numel()
        kern = torch.empty((d, *upper.shape), dtype=torch.result_type(upper, rates), device=upper.device)
        torch.exp(upper.unsqueeze(0) * -rates[:period].view(-1, 1, 1), out=kern[:period])
        for g in range(period, d, period):
            e = min(g + period, d)
            torch.mul(kern[g - period:e - period], kern[g - period:e - period], out=kern[g:e])
    h = kern[:, 0].clone()
    return h.add_(kern[:, 1]).sub_(kern[:, 2]).sub_(kern[:, 3])


class KernelQpError(RuntimeError):
    """The kernel-weight QP could not be solved (non-finite data, no feasible point, or no convergence)."""


def _solve_passive(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    s = np.zeros_like(b)
    idx = np.flatnonzero(passive)
    if idx.size:
        try:  # a[idx][:, idx]: np.ix_ alone was a fifth of MK-MMD₋₁'s QP time when profiled
            s[idx] = np.linalg.solve(a[idx][:, idx], b[idx])
        except np.linalg.LinAlgError as exc:
            raise KernelQpError(f"singular subsystem in the active-set QP: {exc}") from exc
    return s


def nonnegative_qp(a: np.ndarray, b: np.ndarray, *, tol: float = 1e-10, max_iter: int | None = None,
                   warm: np.ndarray | None = None) -> np.ndarray:
    """argmin_z ½·zᵀAz − bᵀz subject to z ≥ 0, for a symmetric positive definite A (exact active-set method).

    Lawson and Hanson's NNLS active-set iteration written on the normal equations (Bro and de Jong's form): it
    ends in finitely many steps at the point satisfying the KKT conditions Az − b ≥ 0 on z = 0 and Az = b on
    z > 0, up to ``tol`` on the gradient (scale b to order one first). ``warm`` (a boolean mask, for example the
    support of the previous solution) is tried as the starting passive set: when the system restricted to it has
    a positive solution the iteration starts there (often already optimal), else it starts from z = 0.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = b.size
    if b.ndim != 1 or a.shape != (n, n):
        raise KernelQpError(f"nonnegative_qp needs a (n, n) matrix and a length-n vector, got {a.shape}, {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise KernelQpError("nonnegative_qp got non-finite input")
    limit = 10 * n + 10 if max_iter is None else max_iter
    z = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    excluded = np.zeros(n, dtype=bool)  # indices that rounding kept from entering at the current z
    w = b.copy()
    if warm is not None and np.shape(warm) == (n,) and np.any(warm):
        start = np.asarray(warm, dtype=bool)
        s = _solve_passive(a, b, start)
        if np.all(s[start] > 0.0):  # a feasible point optimal on its support: the iteration's invariant holds
            z, passive, w = s, start.copy(), b - a @ s
    for _ in range(limit):
        candidates = ~passive & ~excluded
        if not candidates.any():
            return z
        j = int(np.argmax(np.where(candidates, w, -np.inf)))
        if w[j] <= tol:
            return z
        passive[j] = True
        s = _solve_passive(a, b, passive)
        if s[j] <= 0.0:  # only rounding can do this when w_j > 0; keep j out until z moves
            passive[j] = False
            excluded[j] = True
            continue
        for _ in range(n + 1):
            bad = passive & (s <= 0.0)
            if not bad.any():
                break
            ratios = z[bad] / (z[bad] - s[bad])
            alpha = float(ratios.min())
            z = z + alpha * (s - z)
            z[np.flatnonzero(bad)[int(np.argmin(ratios))]] = 0.0
            passive &= z > 0.0
            z[~passive] = 0.0
            s = _solve_passive(a, b, passive)
        else:
            raise KernelQpError("nonnegative_qp: the inner loop did not end")
        z = s
        excluded[:] = False
        w = b - a @ z
    raise KernelQpError(f"nonnegative_qp did not converge in {limit} iterations")


def block_pivoting_qp(a: np.ndarray, b: np.ndarray, *, tol: float = 1e-10, warm: np.ndarray | None = None,
                      max_iter: int = 100) -> np.ndarray | None:
    """argmin_z ½·zᵀAz − bᵀz subject to z ≥ 0 by block principal pivoting, or None if it does not settle.

    The same problem and KKT point as :func:`nonnegative_qp` (the LCP w = Az − b ≥ 0, z ≥ 0, zᵀw = 0, whose
    solution is unique for a positive definite A), found by exchanging every infeasible index at once
    (Júdice and Pires 1994; Portugal, Júdice and Vicente 1994): one linear solve per iteration and usually two
    or three iterations, where the one-index-at-a-time active set takes about six (profiled). After
    three exchanges that do not reduce the infeasible count it moves one index per iteration (Murty's rule),
    which ends in finitely many steps. ``a`` and ``b`` must already be checked (finite, A positive definite).
    """
    n = b.size
    passive = np.zeros(n, dtype=bool) if warm is None else np.asarray(warm, dtype=bool).copy()
    best, budget = n + 1, 3
    z = np.zeros(n)
    for _ in range(max_iter):
        idx = np.flatnonzero(passive)
        z = np.zeros(n)
        if idx.size:
            try:
                z[idx] = np.linalg.solve(a[idx][:, idx], b[idx])
            except np.linalg.LinAlgError:
                return None
        w = a @ z - b
        bad = (passive & (z < 0.0)) | (~passive & (w < -tol))
        count = int(bad.sum())
        if count == 0:
            return z
        if count < best:
            best, budget = count, 3
            passive ^= bad
        elif budget > 0:
            budget -= 1
            passive ^= bad
        else:
            j = int(np.flatnonzero(bad)[-1])
            passive[j] = not passive[j]
    return None


def solve_kernel_qp(d_hat: np.ndarray, q_hat: np.ndarray, epsilon: float = MKMMD_QP_EPSILON,
                    warm: np.ndarray | None = None) -> np.ndarray:
    """argmin_β βᵀ(Q̂ + εI)β subject to β ≥ 0 and d̂ᵀβ = 1 (§3.3), solved exactly.

    With A = Q̂ + εI positive definite, if z solves min_{z ≥ 0} ½zᵀAz − d̂ᵀz then β = z/(d̂ᵀz) satisfies the KKT
    conditions of the QP (multipliers scaled by 2/d̂ᵀz), and d̂ᵀz = zᵀAz > 0 whenever some d̂_j > 0. Raises
    :class:`KernelQpError` when the data are not finite, A is not positive definite or no d̂_j is positive.
    """
    d = np.asarray(d_hat, dtype=np.float64).reshape(-1)
    q = np.asarray(q_hat, dtype=np.float64)
    k = d.size
    if q.shape != (k, k):
        raise KernelQpError(f"Q̂ must be ({k}, {k}) for {k} kernels, got {q.shape}")
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(q))):
        raise KernelQpError("the kernel QP got non-finite d̂ or Q̂")
    if not (d > 0).any():
        raise KernelQpError("the kernel QP is infeasible: no d̂_j is positive")
    a = 0.5 * (q + q.T) + float(epsilon) * np.eye(k)
    try:
        np.linalg.cholesky(a)
    except np.linalg.LinAlgError as exc:
        raise KernelQpError(f"Q̂ + εI is not positive definite: {exc}") from exc
    b = d / float(d.max())  # β is invariant to the scale of d̂
    z = block_pivoting_qp(a, b, warm=warm)
    if z is None:  # not settled: the one-index active set, which always ends
        z = nonnegative_qp(a, b, warm=warm)
    t = float(d @ z)
    if not (t > 0.0 and math.isfinite(t)):
        raise KernelQpError(f"the kernel QP produced d̂ᵀz = {t}")
    return z / t


def choose_kernel_weights(
    d_hat: np.ndarray, q_hat: np.ndarray, previous: np.ndarray, epsilon: float = MKMMD_QP_EPSILON,
    form: QpForm = "paper",
) -> tuple[np.ndarray, RefitOutcome]:
    """New kernel weights β (summing to 1) and how they were found: "qp", "single_kernel" or "kept".

    Some d̂_j > 0: the QP's β, then β ← clamp(β, 0)/Σβ. No d̂_j > 0: the one kernel maximising d̂_j/σ̂_j with
    σ̂_j = sqrt(Q̂_jj + ε) (Gretton et al.'s suggestion, §3.3; ε keeps 0/0 away when both samples coincide). The
    QP fails or the data are not finite: ``previous`` is kept. The QP starts from ``previous``'s support (the
    solution does not depend on it).

    ``form`` "fl4health" is the reference code's: the QP on 2Q̂ + 1e-5·I in its ½-form (``epsilon`` unused;
    the same β as Q̂ + 5e-6·I) and the fallback kernel maximising d̂_j/(2Q̂_jj + 1e-5), without a square root.
    """
    check_choice("qp form", form, _QP_FORMS)
    d = np.asarray(d_hat, dtype=np.float64).reshape(-1)
    q = np.asarray(q_hat, dtype=np.float64)
    prev = np.asarray(previous, dtype=np.float64).reshape(-1).copy()
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(q))):
        return prev, "kept"
    if not (d > 0).any():
        if form == "paper":
            scale = np.sqrt(np.clip(np.diag(q), 0.0, None) + float(epsilon))
        else:
            scale = 2.0 * np.diag(q) + FL4HEALTH_QP_SHIFT
        beta = np.zeros_like(d)
        beta[int(np.argmax(d / scale))] = 1.0
        return beta, "single_kernel"
    shift = float(epsilon) if form == "paper" else FL4HEALTH_QP_SHIFT / 2.0
    try:
        beta = solve_kernel_qp(d, q, shift, warm=prev > 0)
    except KernelQpError:
        return prev, "kept"
    beta = np.clip(beta, 0.0, None)
    total = float(beta.sum())
    if not (total > 0.0 and math.isfinite(total)):
        return prev, "kept"
    return beta / total, "qp"


class MkMmdLoss(nn.Module):
    """MK-MMD² = Σ_j β_j·d̂_j between two same-size feature samples (§3.3), with β refit by the paper's QP.

    ``forward`` returns β·d̂ with β held fixed (gradients reach the features only); :meth:`refit` recomputes β
    from d̂ and Q̂ on a (larger, gradient-free) sample. Options, paper first:

    - ``bandwidth_form``: "rate", k_j = exp(−γ_j‖a − b‖²) (paper); "scale", exp(−‖a − b‖²/γ_j) (reference code).
    - ``estimator``: "unbiased" U-statistic over pairs i ≠ k (the quadratic estimate the paper's Gretton et al.
      reference defines; the paper's fallback for "no positive d̂_j" only arises with it); "biased", the
      reference code's mean over all n² pairs, which also adds a paired term 2 − 2k(x_i, y_i) per row.
    - ``normalize_features``: divide each feature row by its L2 norm first. The paper is silent; the reference
      code's Ditto client does it, and the γ grid (‖a − b‖² ≤ 4 on unit rows) is only sensible with it, so it is
      on by default.
    - ``epsilon``: the QP's shift ε (paper 1e-3).
    - ``qp_form``: "paper", Q̂ + εI; "fl4health", the reference code's 2Q̂ + 1e-5·I in a ½-form QP and its
      fallback (see :func:`choose_kernel_weights`).
    - ``beta_init``: "uniform" 1/d each; "random", the reference code's torch.rand start normalised to sum 1
      (drawn from ``seed``). It matters until the first refit and as the QP's warm start.

    β is a buffer, so it persists in ``state_dict`` across rounds.
    """

    gammas: torch.Tensor
    beta: torch.Tensor

    def __init__(
        self,
        gammas: Sequence[float] | torch.Tensor | None = None,
        *,
        epsilon: float = MKMMD_QP_EPSILON,
        normalize_features: bool = True,
        bandwidth_form: BandwidthForm = "rate",
        estimator: MmdEstimator = "unbiased",
        qp_form: QpForm = "paper",
        beta_init: BetaInit = "uniform",
        seed: int = 0,
        dtype: torch.dtype = KERNEL_DTYPE,
    ) -> None:
        super().__init__()
        self.dtype = check_kernel_dtype("MK-MMD", dtype)
        g = paper_gammas(dtype) if gammas is None else torch.as_tensor(gammas, dtype=dtype).reshape(-1).clone()
        if g.numel() < 1 or not bool(torch.all(torch.isfinite(g) & (g > 0))):
            raise ValueError(f"MK-MMD gammas must be a non-empty list of positive numbers, got {g.tolist()}")
        check_choice("bandwidth_form", bandwidth_form, BANDWIDTH_FORMS)
        check_choice("estimator", estimator, ESTIMATORS)
        self.epsilon = check_positive("MK-MMD epsilon", epsilon)
        self.normalize_features = bool(normalize_features)
        self.bandwidth_form: BandwidthForm = bandwidth_form
        self.estimator: MmdEstimator = estimator
        self.register_buffer("gammas", g)
        check_choice("qp_form", qp_form, _QP_FORMS)
        check_choice("beta_init", beta_init, _BETA_INITS)
        self.qp_form: QpForm = qp_form
        if beta_init == "uniform":
            start = torch.full_like(g, 1.0 / g.numel())
        else:  # the reference code's torch.rand start, normalised to sum 1, from this module's own seed
            u = torch.rand(g.numel(), generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
            start = (u / u.sum()).to(dtype)  # drawn in float64 whatever the dtype: one start per seed
        self.register_buffer("beta", start)
        self.last_refit: RefitOutcome | None = None

    def _prepare(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf, yf = as_feature_pair(x, y, "MK-MMD", self.dtype)
        if self.normalize_features:
            xf, yf = F.normalize(xf, dim=1), F.normalize(yf, dim=1)
        return xf, yf

    def _estimates_and_stack(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d̂ differentiable in x and y, the kernel stack k_j(z_a, z_b) for z = [x; y] without gradient).

        One distance matrix and one exp for all kernels and all three blocks (K_xx, K_yy, K_xy and its
        transpose), and one autograd node (:class:`_StackEstimates`): the per-step path (profiled:
        three distance matrices and three kernel stacks, each its own autograd nodes, cost as much as Ditto's
        whole step).
        """
        xf, yf = as_feature_pair(x, y, "MK-MMD", self.dtype)
        z = torch.cat((xf, yf), dim=0)
        if self.normalize_features:  # row by row, so once on [x; y]
            z = F.normalize(z, dim=1)
        rates = self.gammas if self.bandwidth_form == "rate" else 1.0 / self.gammas
        weights = _pair_weights(xf.shape[0], self.estimator, z.dtype, z.device)
        d_hat, k = _StackEstimates.apply(z, rates, weights)
        return d_hat, k

    def per_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The per-kernel estimates d̂_j (in the module's dtype, differentiable in x and y)."""
        return self._estimates_and_stack(x, y)[0]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Σ_j β_j·d̂_j(x, y) in x's dtype; β is a constant here."""
        return torch.dot(self.beta.detach(), self.per_kernel(x, y)).to(x.dtype)

    @torch.no_grad()
    def statistics(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d̂, Q̂) of two samples, without gradients (in the module's dtype)."""
        xf, yf = self._prepare(x, y)
        return mkmmd_statistics(xf, yf, self.gammas, self.bandwidth_form, self.estimator)

    @torch.no_grad()
    def refit(self, x: torch.Tensor, y: torch.Tensor) -> RefitOutcome:
        """Recompute β from two samples (QP, else the single-kernel fallback, else keep β); says which happened."""
        d_hat, q_hat = self.statistics(x, y)
        return self._set_beta(d_hat, q_hat)

    @torch.no_grad()
    def _set_beta(self, d_hat: torch.Tensor, q_hat: torch.Tensor) -> RefitOutcome:
        return self._set_beta_np(d_hat.cpu().numpy(), q_hat.cpu().numpy())

    def refit_and_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Refit β on these samples, then Σ_j β_j·d̂_j(x, y): :meth:`refit` and :meth:`forward` on the same batch
        (MK-MMD₋₁) with the kernels computed once; the same values as the two calls (to rounding).

        d̂ and Q̂ for the QP come from the kernel stack in numpy: on a 10-row batch every torch call costs more
        than its arithmetic (profiled).
        """
        d_hat, k = self._estimates_and_stack(x, y)
        d0 = d_hat.detach().cpu().numpy()
        kn = k.detach().cpu().numpy()
        n = kn.shape[1] // 2
        kxy = kn[:, :n, n:]
        h = (kn[:, :n, :n] + kn[:, n:, n:] - kxy - kxy.transpose(0, 2, 1)).reshape(kn.shape[0], n * n)
        if self.estimator == "unbiased":
            h = h[:, _off_diagonal(n)]
        centred = h - d0[:, None]
        self._set_beta_np(d0, (centred @ centred.T) / (h.shape[1] - 1))
        return torch.dot(self.beta.detach(), d_hat).to(x.dtype)

    def _set_beta_np(self, d_hat: np.ndarray, q_hat: np.ndarray) -> RefitOutcome:
        beta, how = choose_kernel_weights(d_hat, q_hat, self.beta.cpu().numpy(), self.epsilon, self.qp_form)
        with torch.no_grad():
            self.beta.copy_(torch.from_numpy(beta).to(self.beta.dtype))
        self.last_refit = how
        return how


_OFF_DIAGONAL: dict[int, np.ndarray] = {}


def _off_diagonal(n: int) -> np.ndarray:
    """The flat indices of the off-diagonal entries of an n × n matrix (row-major), cached per n."""
    if n not in _OFF_DIAGONAL:
        _OFF_DIAGONAL[n] = np.flatnonzero(~np.eye(n, dtype=bool))
    return _OFF_DIAGONAL[n]


class _StackEstimates(torch.autograd.Function):
    """(d̂_j = Σ_ab W_ab·exp(−r_j·D_ab), the stack exp(−r_j·D)) for D the squared distances of z's rows.

    The backward is the chain rule written out: ∂/∂D = −W∘Σ_j g_j·r_j·k_j (zero where D was clamped at 0, as
    autograd's clamp), ∂/∂z = 2(diag(S𝟙)z − Sz) with S = ∂/∂D + (∂/∂D)ᵀ. The stack is a constant output.
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, rates: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """d̂ (d,) and the kernel stack (d, 2n, 2n), with squared_distances' and rbf's expressions."""
        norms = (z * z).sum(dim=1, keepdim=True)
        raw = norms + norms.transpose(0, 1) - 2.0 * (z @ z.transpose(0, 1))
        clamped = raw < 0.0
        k = torch.exp(-rates.view(-1, 1, 1) * raw.clamp_min(0.0))
        ctx.save_for_backward(z, rates, weights, k, clamped)
        ctx.mark_non_differentiable(k)
        return (k * weights).sum(dim=(1, 2)), k

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_stack: Any) -> tuple[Any, ...]:
        """The gradient for z from that of d̂."""
        z, rates, weights, k, clamped = ctx.saved_tensors
        dd = torch.tensordot(g * rates, k, dims=1).mul_(weights).neg_().masked_fill_(clamped, 0.0)
        s = dd + dd.transpose(0, 1)
        return 2.0 * (s.sum(dim=1, keepdim=True) * z - s @ z), None, None


_WEIGHTS: dict[tuple[int, str, torch.dtype, torch.device], torch.Tensor] = {}


def _pair_weights(n: int, estimator: MmdEstimator, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """W (2n, 2n) with d̂_j = Σ_ab W_ab·k_j(z_a, z_b) for z = [x; y]: +1 on the xx and yy blocks, −1 on xy and yx,
    over n(n − 1) without the blocks' diagonals ("unbiased", pairs i ≠ k) or over n² with them ("biased")."""
    key = (n, estimator, dtype, device)
    if key not in _WEIGHTS:
        block = torch.ones((n, n), dtype=dtype, device=device)
        if estimator == "unbiased":
            block.fill_diagonal_(0.0)
            block /= n * (n - 1)
        else:
            block /= n * n
        _WEIGHTS[key] = torch.cat((torch.cat((block, -block), 1), torch.cat((-block, block), 1)), 0)
    return _WEIGHTS[key]
