"""Ditto's latent-space drift measures: MK-MMD (§3.3), MMD-D (§3.4) and the cosine baseline, as torch modules.

Paper: Ayromlou & Emerson, "Adaptive Latent-Space Constraints in Personalized FL" (shared/papers/001). Public
reference code, read for understanding only: VectorInstitute/FL4Health (fl4health/losses/mkmmd_loss.py,
fl4health/losses/deep_mmd_loss.py, fl4health/clients/*_clients/ditto_*_client.py). Where the two differ, the
paper's form is the default and the code's form is a named option (see each class).

Numeric type: every kernel computation runs in float64 (:data:`KERNEL_DTYPE`). Features are cast on entry and
each loss comes back in the dtype of its input features, so the gradient still reaches a float32 model. An MMD²
estimate is a difference of kernel sums of order one that nearly cancel while the personal model is close to the
frozen global one (estimates of 1e-6 and below are common early in a round), and Q̂ is built from products of
such differences; float32 would leave two or three significant digits there. The samples are small (one batch
of 10 rows per training step, s batches per refit), so float64 costs little on a CPU. The MMD-D kernel's own
parameters are float64 as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "KERNEL_DTYPE",
    "CosineDrift",
    "DeepKernelFeaturizer",
    "KernelQpError",
    "MkMmdLoss",
    "MmdDLoss",
    "RefitSchedule",
    "add_proximal_gradient",
    "choose_kernel_weights",
    "forward_with_features",
    "forward_with_layers",
    "gather_features",
    "mkmmd_covariance",
    "mkmmd_estimates",
    "mkmmd_statistics",
    "mmd2_unbiased",
    "mmd2_variance",
    "named_layer",
    "nonnegative_qp",
    "pair_statistics",
    "paper_gammas",
    "solve_kernel_qp",
    "squared_distances",
]

KERNEL_DTYPE = torch.float64
"""The one dtype of all kernel maths here (see the module docstring)."""

MKMMD_QP_EPSILON = 1e-3
"""The paper's stabilising shift ε of Q̂ + εI (§3.3). The reference code uses 2·Q̂ + 1e-5·I in a ½zᵀQz QP."""

FL4HEALTH_QP_SHIFT = 1e-5
"""The reference code's shift: it solves min ½βᵀ(2Q̂ + 1e-5·I)β (mkmmd_loss.py, ``optimize_betas``'s lambda_m),
the same β as min βᵀ(Q̂ + 5e-6·I)β."""

MMDD_VARIANCE_REG = 1e-8
"""The paper's λ of the regularised variance estimate (§3.4, Liu et al. 2020 eq. 5)."""

BandwidthForm = Literal["rate", "scale"]
MmdEstimator = Literal["unbiased", "biased"]
DeepKernelForm = Literal["paper", "liu"]
RefitOutcome = Literal["qp", "single_kernel", "kept"]
QpForm = Literal["paper", "fl4health"]
BetaInit = Literal["uniform", "random"]

_BANDWIDTH_FORMS: tuple[str, ...] = ("rate", "scale")
_ESTIMATORS: tuple[str, ...] = ("unbiased", "biased")
_DEEP_KERNEL_FORMS: tuple[str, ...] = ("paper", "liu")
_QP_FORMS: tuple[str, ...] = ("paper", "fl4health")
_BETA_INITS: tuple[str, ...] = ("uniform", "random")


# --------------------------------------------------------------------------------------------------
# Shared kernel pieces
# --------------------------------------------------------------------------------------------------


def paper_gammas() -> torch.Tensor:
    """The RBF parameters γ_j = 2^p for p = −3.5, −3.25, …, 1: 19 values in float64.

    The paper (§3.3, Appendix C) names this grid and also says d = 18; the grid from −3.5 to 1 in steps of 0.25
    holds 19 points, and the reference code builds the same 19 (``arange(-3.5, 1.25, 0.25)``), so 19 are used.
    """
    return torch.pow(2.0, torch.arange(-14, 5, dtype=KERNEL_DTYPE) / 4.0)


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances ‖x_i − y_k‖² of two row sets (n×m), clamped at 0 against rounding."""
    xx = (x * x).sum(dim=1, keepdim=True)
    yy = (y * y).sum(dim=1, keepdim=True)
    return (xx + yy.transpose(0, 1) - 2.0 * (x @ y.transpose(0, 1))).clamp_min(0.0)


_SQUARING_MIN_ELEMENTS = 4096
"""Distance arrays at least this large take the squaring path of :func:`_rbf` (smaller ones: one exp call)."""


def _doubling_period(rates: torch.Tensor) -> int:
    """The p with r[j + p] = 2·r[j] for the rates r in ascending order (to 1e-12), or 0: then k_{j+p} = k_j²."""
    r = sorted(rates.detach().cpu().tolist())
    for p in range(1, len(r)):
        if all(abs(r[j + p] - 2.0 * r[j]) <= 1e-12 * r[j + p] for j in range(len(r) - p)):
            return p
    return 0


def _rbf(sq: torch.Tensor, gammas: torch.Tensor, form: BandwidthForm) -> torch.Tensor:
    """exp(−rate_j·sq) for every kernel j, stacked (d, ...sq): rate γ_j ("rate") or 1/γ_j ("scale").

    On a large ``sq`` whose rates double every p kernels in ascending order (the paper's 2^{p/4} grid: p = 4),
    only the p smallest rates call exp and each other kernel is the square of the one whose rate is half its
    own (exp(−2a) = exp(−a)²): the same values to a few ulp, at a fraction of the cost (issue 23's profile:
    exp was most of a 500-row refit). Not on a graph: the in-place writes are gradient-free.
    """
    rates = gammas if form == "rate" else 1.0 / gammas
    differentiable = torch.is_grad_enabled() and (sq.requires_grad or rates.requires_grad)
    period = _doubling_period(rates) if sq.numel() >= _SQUARING_MIN_ELEMENTS and not differentiable else 0
    if period == 0:
        return torch.exp(-rates.view(-1, *([1] * sq.dim())) * sq)
    order = torch.argsort(rates.detach().cpu()).tolist()
    out = torch.empty((rates.numel(), *sq.shape), dtype=torch.result_type(sq, rates), device=sq.device)
    for s, j in enumerate(order):
        if s < period:
            torch.exp(sq * -float(rates[j]), out=out[j])
        else:
            half = out[order[s - period]]
            torch.mul(half, half, out=out[j])
    return out
def _as_feature_pair(x: torch.Tensor, y: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten both samples to (n, features) in KERNEL_DTYPE, checking they are same-size with n ≥ 2."""
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(f"{what} needs feature batches of shape (n, ...), got {tuple(x.shape)} and {tuple(y.shape)}")
    xf, yf = x.flatten(1), y.flatten(1)
    if xf.shape != yf.shape:
        raise ValueError(
            f"{what} needs two samples of the same size and width (the unbiased cross term pairs them), "
            f"got {tuple(xf.shape)} and {tuple(yf.shape)}"
        )
    if xf.shape[0] < 2:
        raise ValueError(f"{what} needs at least 2 rows per sample, got {xf.shape[0]}")
    return xf.to(KERNEL_DTYPE), yf.to(KERNEL_DTYPE)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def _check_positive(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


# --------------------------------------------------------------------------------------------------
# MK-MMD (§3.3)
# --------------------------------------------------------------------------------------------------


def pair_statistics(
    x: torch.Tensor, y: torch.Tensor, gammas: torch.Tensor, form: BandwidthForm = "rate"
) -> torch.Tensor:
    """h_j(i, k) = k_j(x_i, x_k) + k_j(y_i, y_k) − k_j(x_i, y_k) − k_j(x_k, y_i) for every kernel j: (d, n, n).

    ``form`` "rate" is the paper's k_j(a, b) = exp(−γ_j‖a − b‖²); "scale" is the reference code's
    exp(−‖a − b‖²/γ_j). x and y are same-size samples of rows (already in the dtype wanted).
    """
    _check_choice("bandwidth_form", form, _BANDWIDTH_FORMS)
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"pair_statistics needs two (n, features) samples of one shape, got {x.shape} and {y.shape}")
    kxx = _rbf(squared_distances(x, x), gammas, form)
    kyy = _rbf(squared_distances(y, y), gammas, form)
    kxy = _rbf(squared_distances(x, y), gammas, form)
    return kxx + kyy - kxy - kxy.transpose(1, 2)


def mkmmd_estimates(h: torch.Tensor, estimator: MmdEstimator = "unbiased") -> torch.Tensor:
    """The per-kernel MMD² estimates d̂_j from the pair statistics h (d, n, n).

    "unbiased": the quadratic-time U-statistic, the mean of h over pairs i ≠ k (Gretton et al. 2012, MMD²_u).
    "biased": the reference code's mean over all n² pairs, diagonal included (the V-statistic, always ≥ 0).
    """
    _check_choice("estimator", estimator, _ESTIMATORS)
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
    _check_choice("estimator", estimator, _ESTIMATORS)
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
    batches (500 rows) took 0.4 s with the full tensors (issue 23's profile).
    """
    _check_choice("bandwidth_form", form, _BANDWIDTH_FORMS)
    _check_choice("estimator", estimator, _ESTIMATORS)
    if x.shape != y.shape or x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"mkmmd_statistics needs two (n, features) samples of one shape, n >= 2, got {x.shape} "
                         f"and {y.shape}")
    n = x.shape[0]
    d = gammas.numel()
    i, k = torch.triu_indices(n, n, offset=1, device=x.device)
    dxx, dyy, dxy = squared_distances(x, x), squared_distances(y, y), squared_distances(x, y)
    upper = torch.stack([dxx[i, k], dyy[i, k], dxy[i, k], dxy[k, i]])  # (4, n(n−1)/2)
    # Weighted groups (values, weight per value): each off-diagonal pair twice; the diagonal once if biased.
    groups: list[tuple[torch.Tensor, float]] = []
    for start in range(0, upper.shape[1], _STATISTICS_CHUNK):
        kern = _rbf(upper[:, start:start + _STATISTICS_CHUNK], gammas, form)  # (d, 4, chunk)
        groups.append((kern[:, 0] + kern[:, 1] - kern[:, 2] - kern[:, 3], 2.0))
    if estimator == "biased":  # k(x_i, x_i) = k(y_i, y_i) = 1, so h_j(i, i) = 2 − 2·k_j(x_i, y_i)
        groups.append((2.0 - 2.0 * _rbf(dxy.diagonal().unsqueeze(0), gammas, form)[:, 0], 1.0))
    count = 0.0
    mean = x.new_zeros(d)
    m2 = x.new_zeros((d, d))
    for h, w in groups:
        nb = w * h.shape[1]
        mb = h.mean(dim=1)
        c = h - mb.unsqueeze(1)
        delta = mb - mean
        total = count + nb
        m2 = m2 + w * (c @ c.transpose(0, 1)) + torch.outer(delta, delta) * (count * nb / total)
        mean = mean + delta * (nb / total)
        count = total
    return mean, m2 / (count - 1)


class KernelQpError(RuntimeError):
    """The kernel-weight QP could not be solved (non-finite data, no feasible point, or no convergence)."""


def _solve_passive(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    s = np.zeros_like(b)
    if passive.any():
        try:
            s[passive] = np.linalg.solve(a[np.ix_(passive, passive)], b[passive])
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
    z = nonnegative_qp(a, d / float(d.max()), warm=warm)  # β is invariant to the scale of d̂
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
    _check_choice("qp form", form, _QP_FORMS)
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
    ) -> None:
        super().__init__()
        g = paper_gammas() if gammas is None else torch.as_tensor(gammas, dtype=KERNEL_DTYPE).reshape(-1).clone()
        if g.numel() < 1 or not bool(torch.all(torch.isfinite(g) & (g > 0))):
            raise ValueError(f"MK-MMD gammas must be a non-empty list of positive numbers, got {g.tolist()}")
        _check_choice("bandwidth_form", bandwidth_form, _BANDWIDTH_FORMS)
        _check_choice("estimator", estimator, _ESTIMATORS)
        self.epsilon = _check_positive("MK-MMD epsilon", epsilon)
        self.normalize_features = bool(normalize_features)
        self.bandwidth_form: BandwidthForm = bandwidth_form
        self.estimator: MmdEstimator = estimator
        self.register_buffer("gammas", g)
        _check_choice("qp_form", qp_form, _QP_FORMS)
        _check_choice("beta_init", beta_init, _BETA_INITS)
        self.qp_form: QpForm = qp_form
        if beta_init == "uniform":
            start = torch.full_like(g, 1.0 / g.numel())
        else:  # the reference code's torch.rand start, normalised to sum 1, from this module's own seed
            u = torch.rand(g.numel(), generator=torch.Generator().manual_seed(int(seed)), dtype=KERNEL_DTYPE)
            start = u / u.sum()
        self.register_buffer("beta", start)
        self.last_refit: RefitOutcome | None = None

    def _prepare(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf, yf = _as_feature_pair(x, y, "MK-MMD")
        if self.normalize_features:
            xf, yf = F.normalize(xf, dim=1), F.normalize(yf, dim=1)
        return xf, yf

    def per_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The per-kernel estimates d̂_j (float64, differentiable in x and y)."""
        xf, yf = self._prepare(x, y)
        return mkmmd_estimates(pair_statistics(xf, yf, self.gammas, self.bandwidth_form), self.estimator)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Σ_j β_j·d̂_j(x, y) in x's dtype; β is a constant here."""
        return (self.beta.detach() * self.per_kernel(x, y)).sum().to(x.dtype)

    @torch.no_grad()
    def statistics(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d̂, Q̂) of two samples, without gradients (float64)."""
        xf, yf = self._prepare(x, y)
        return mkmmd_statistics(xf, yf, self.gammas, self.bandwidth_form, self.estimator)

    @torch.no_grad()
    def refit(self, x: torch.Tensor, y: torch.Tensor) -> RefitOutcome:
        """Recompute β from two samples (QP, else the single-kernel fallback, else keep β); says which happened."""
        d_hat, q_hat = self.statistics(x, y)
        return self._set_beta(d_hat, q_hat)

    @torch.no_grad()
    def _set_beta(self, d_hat: torch.Tensor, q_hat: torch.Tensor) -> RefitOutcome:
        beta, how = choose_kernel_weights(
            d_hat.cpu().numpy(), q_hat.cpu().numpy(), self.beta.cpu().numpy(), self.epsilon, self.qp_form
        )
        self.beta.copy_(torch.as_tensor(beta, dtype=self.beta.dtype))
        self.last_refit = how
        return how

    def refit_and_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Refit β on these samples, then Σ_j β_j·d̂_j(x, y): :meth:`refit` and :meth:`forward` on the same batch
        (MK-MMD₋₁) with the pair statistics computed once; the same values as the two calls."""
        xf, yf = self._prepare(x, y)
        h = pair_statistics(xf, yf, self.gammas, self.bandwidth_form)
        d_hat = mkmmd_estimates(h, self.estimator)
        with torch.no_grad():
            h0, d0 = h.detach(), d_hat.detach()
            self._set_beta(d0, mkmmd_covariance(h0, d0, self.estimator))
        return (self.beta.detach() * d_hat).sum().to(x.dtype)


# --------------------------------------------------------------------------------------------------
# MMD-D (§3.4)
# --------------------------------------------------------------------------------------------------


def _h_matrix(kxx: torch.Tensor, kyy: torch.Tensor, kxy: torch.Tensor) -> torch.Tensor:
    if not (kxx.shape == kyy.shape == kxy.shape) or kxx.dim() != 2 or kxx.shape[0] != kxx.shape[1]:
        raise ValueError(
            f"kernel matrices must be square and of one size, got {kxx.shape}, {kyy.shape}, {kxy.shape}"
        )
    if kxx.shape[0] < 2:
        raise ValueError("MMD estimates need at least 2 rows per sample")
    return kxx + kyy - kxy - kxy.transpose(0, 1)


def mmd2_unbiased(kxx: torch.Tensor, kyy: torch.Tensor, kxy: torch.Tensor) -> torch.Tensor:
    """The unbiased MMD² estimate (Liu et al. 2020 eq. 2): Σ_{i≠j} H_ij / (n(n−1)), H = K_xx + K_yy − K_xy − K_xyᵀ."""
    h = _h_matrix(kxx, kyy, kxy)
    n = h.shape[0]
    return (h.sum() - torch.diagonal(h).sum()) / (n * (n - 1))


def mmd2_variance(
    kxx: torch.Tensor, kyy: torch.Tensor, kxy: torch.Tensor, reg: float = MMDD_VARIANCE_REG
) -> torch.Tensor:
    """The regularised variance estimate σ̂² = (4/n³)‖H𝟙‖² − (4/n⁴)(𝟙ᵀH𝟙)² + reg (Liu et al. 2020 eq. 5)."""
    h = _h_matrix(kxx, kyy, kxy)
    n = h.shape[0]
    row = h.sum(dim=1)
    return (4.0 / n**3) * (row * row).sum() - (4.0 / n**4) * h.sum() ** 2 + reg


class DeepKernelFeaturizer(nn.Sequential):
    """MMD-D's featuriser φ: Linear(in, h) → Softplus → Linear(h, h) → Softplus → Linear(h, h) → Softplus → Linear(h, out).

    The reference code's network (h = 10, out = 50); the paper does not give one.
    """

    def __init__(self, in_features: int, hidden_features: int = 10, out_features: int = 50) -> None:
        for name, v in (("in_features", in_features), ("hidden_features", hidden_features),
                        ("out_features", out_features)):
            if int(v) < 1:
                raise ValueError(f"MMD-D featuriser {name} must be >= 1, got {v}")
        super().__init__(
            nn.Linear(in_features, hidden_features),
            nn.Softplus(),
            nn.Linear(hidden_features, hidden_features),
            nn.Softplus(),
            nn.Linear(hidden_features, hidden_features),
            nn.Softplus(),
            nn.Linear(hidden_features, out_features),
        )


class MmdDLoss(nn.Module):
    """MMD-D: the unbiased MMD² under a trained deep kernel k_ω (§3.4), a module whose state persists across rounds.

    k_ω(a, b) = (1 − ε)·k(φ(a), φ(b)) + ε·q(a, b) with RBF k(u, v) = exp(−‖u − v‖²/σ_φ) and
    q(a, b) = exp(−‖a − b‖²/σ_q) (the paper's γ_k = 1/σ_φ, γ_q = 1/σ_q). ``kernel_form`` "liu" is the
    reference code's (and Liu et al.'s) form [(1 − ε)·k(φ(a), φ(b)) + ε]·q(a, b).

    Trained parameters ω = (φ, ε, σ_φ, σ_q), parameterised as the reference code does: ε = sigmoid(e),
    σ_φ = s_φ², σ_q = s_q², with its initial values ε ≈ 1e-10, σ_φ = 0.005, σ_q = 2·32·32 (the last is a
    leftover of 32×32 images in Liu et al.'s code). :meth:`train_kernel` takes ``train_steps`` AdamW steps
    (lr 1e-3, torch's other defaults) on −MMD²_u/σ̂ with σ̂² clamped at ``MMDD_VARIANCE_REG`` before the square
    root, the second sample shuffled each step (``shuffle_pairs``, reference code) so that no pairing of rows
    is learnt. The AdamW moments live in this object, so keep the object (not only its state_dict) across rounds
    to carry them. ``forward`` holds ω fixed: its gradient reaches the features only.
    """

    def __init__(
        self,
        in_features: int,
        *,
        hidden_features: int = 10,
        out_features: int = 50,
        kernel_form: DeepKernelForm = "paper",
        epsilon_init: float = 1e-10,
        sigma_phi_init: float = 0.005,
        sigma_q_init: float = 2.0 * 32 * 32,
        lr: float = 1e-3,
        train_steps: int = 5,
        shuffle_pairs: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        _check_choice("kernel_form", kernel_form, _DEEP_KERNEL_FORMS)
        eps0 = float(epsilon_init)
        if not 0.0 < eps0 < 1.0:
            raise ValueError(f"MMD-D epsilon_init must be in (0, 1), got {epsilon_init!r}")
        sigma_phi = _check_positive("MMD-D sigma_phi_init", sigma_phi_init)
        sigma_q = _check_positive("MMD-D sigma_q_init", sigma_q_init)
        self.lr = _check_positive("MMD-D lr", lr)
        if int(train_steps) < 0:
            raise ValueError(f"MMD-D train_steps must be >= 0, got {train_steps}")
        self.train_steps = int(train_steps)
        self.kernel_form: DeepKernelForm = kernel_form
        self.shuffle_pairs = bool(shuffle_pairs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.featurizer = DeepKernelFeaturizer(in_features, hidden_features, out_features).to(KERNEL_DTYPE)
        self.eps_logit = nn.Parameter(torch.tensor(math.log(eps0 / (1.0 - eps0)), dtype=KERNEL_DTYPE))
        self.sigma_phi_root = nn.Parameter(torch.tensor(math.sqrt(sigma_phi), dtype=KERNEL_DTYPE))
        self.sigma_q_root = nn.Parameter(torch.tensor(math.sqrt(sigma_q), dtype=KERNEL_DTYPE))
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        self._shuffle_rng = torch.Generator().manual_seed(int(seed))

    @property
    def epsilon(self) -> float:
        """The current mixing weight ε."""
        return float(torch.sigmoid(self.eps_logit.detach()))

    @property
    def sigmas(self) -> tuple[float, float]:
        """The current (σ_φ, σ_q)."""
        return float(self.sigma_phi_root.detach() ** 2), float(self.sigma_q_root.detach() ** 2)

    def kernel_matrices(
        self, x: torch.Tensor, y: torch.Tensor, *, train: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K_xx, K_yy, K_xy) under k_ω; ω takes gradients only when ``train``."""
        xf, yf = _as_feature_pair(x, y, "MMD-D")
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        if not train:
            params = {k: v.detach() for k, v in params.items()}
        z = torch.cat([xf, yf], dim=0)
        phi = z
        for layer in self.featurizer:
            if isinstance(layer, nn.Linear):
                w, b = layer.weight, layer.bias
                phi = F.linear(phi, w if train else w.detach(), b if train else b.detach())
            else:
                phi = layer(phi)
        eps = torch.sigmoid(params["eps_logit"])
        sigma_phi = params["sigma_phi_root"] ** 2
        sigma_q = params["sigma_q_root"] ** 2
        d_phi = squared_distances(phi, phi)
        d_in = squared_distances(z, z)
        q = torch.exp(-d_in / sigma_q)
        if self.kernel_form == "paper":
            k = (1.0 - eps) * torch.exp(-d_phi / sigma_phi) + eps * q
        else:
            k = ((1.0 - eps) * torch.exp(-d_phi / sigma_phi) + eps) * q
        n = xf.shape[0]
        return k[:n, :n], k[n:, n:], k[:n, n:]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The unbiased MMD²_u(x, y) under the current kernel, in x's dtype; the kernel gets no gradient."""
        return mmd2_unbiased(*self.kernel_matrices(x, y)).to(x.dtype)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MMD²_u, σ̂²) with gradients into the kernel parameters (float64)."""
        kxx, kyy, kxy = self.kernel_matrices(x, y, train=True)
        return mmd2_unbiased(kxx, kyy, kxy), mmd2_variance(kxx, kyy, kxy)

    def shuffled_criterion(self, z: torch.Tensor, d_in: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """MMD²_u/σ̂ of (x, y[perm]) with gradients into ω, from z = [x; y] and its cached distances d_in.

        The same value as :meth:`objective` on (x, y[perm]) without building a permuted or sliced matrix: every
        term of MMD²_u and σ̂² is a sum of H's rows, and the rows of H for (x, y[perm]) are
        rowsum(K_xx)_i + rowsum(K_yy)_π(i) − rowsum(K_xy)_i − colsum(K_xy)_π(i), read off K·S with S the two
        block indicators; the trace needs only K_xy[i, π(i)]. About half a kernel step's former cost (issue 23).
        """
        n = z.shape[0] // 2
        phi = self.featurizer(z)
        eps = torch.sigmoid(self.eps_logit)
        # The (2n, 2n) matrices see no scalar parameter: ε multiplies their (2n, 2) block sums only.
        k_phi = torch.exp(squared_distances(phi, phi) / -(self.sigma_phi_root**2))
        q = torch.exp(d_in / -(self.sigma_q_root**2))
        first = k_phi if self.kernel_form == "paper" else k_phi * q  # K = (1 − ε)·first + ε·q
        blocks = z.new_zeros((2 * n, 2))
        blocks[:n, 0] = 1.0
        blocks[n:, 1] = 1.0
        sums = (1.0 - eps) * (first @ blocks) + eps * (q @ blocks)  # (2n, 2): row sums over x and y columns
        pi = perm + n
        rows = sums[:n, 0] + sums[pi, 1] - sums[:n, 1] - sums[pi, 0]  # H·1 for (x, y[perm])

        def entries(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            # k_ω(z_r, z_c) for listed pairs, from the rows themselves (no gather from, or gradient into, a
            # (2n, 2n) matrix): the diagonal and the pairs (x_i, y_π(i)) of the trace
            e_phi = torch.exp(((phi[r] - phi[c]) ** 2).sum(dim=1) / -(self.sigma_phi_root**2))
            e_q = torch.exp(((z[r] - z[c]) ** 2).sum(dim=1) / -(self.sigma_q_root**2))
            f = e_phi if self.kernel_form == "paper" else e_phi * e_q
            return (1.0 - eps) * f + eps * e_q

        ar = torch.arange(n, device=z.device)
        trace = (2.0 * entries(ar, ar) - 2.0 * entries(ar, pi)).sum()  # K_xx,ii = K_yy,ii: a point with itself
        total = rows.sum()
        mmd2 = (total - trace) / (n * (n - 1))
        var = (4.0 / n**3) * (rows * rows).sum() - (4.0 / n**4) * total**2 + MMDD_VARIANCE_REG
        return mmd2 / torch.sqrt(var.clamp_min(MMDD_VARIANCE_REG))

    def train_kernel(self, x: torch.Tensor, y: torch.Tensor, steps: int | None = None) -> list[float]:
        """Take ``steps`` (default ``train_steps``) AdamW steps on −MMD²_u/σ̂; returns the criterion MMD²_u/σ̂ before each."""
        n_steps = self.train_steps if steps is None else int(steps)
        xd, yd = _as_feature_pair(x.detach(), y.detach(), "MMD-D")
        n = xd.shape[0]
        z = torch.cat([xd, yd], dim=0)
        d_in = squared_distances(z, z)  # the inputs do not change during the refit: computed once
        values: list[float] = []
        with torch.enable_grad():
            for _ in range(n_steps):
                if self.shuffle_pairs:
                    perm = torch.randperm(n, generator=self._shuffle_rng).to(z.device)
                else:
                    perm = torch.arange(n, device=z.device)
                self.optimizer.zero_grad(set_to_none=True)
                criterion = self.shuffled_criterion(z, d_in, perm)
                (-criterion).backward()
                self.optimizer.step()
                values.append(float(criterion.detach()))
        self.optimizer.zero_grad(set_to_none=True)
        return values


# --------------------------------------------------------------------------------------------------
# Cosine baseline
# --------------------------------------------------------------------------------------------------


class CosineDrift(nn.Module):
    """The paired baseline 1 − mean_b cos(f_L(x_b), f_G(x_b)) (the caller multiplies by μ); in x's dtype."""

    def forward(self, f_local: torch.Tensor, f_global: torch.Tensor) -> torch.Tensor:
        """One minus the batch mean of the row-wise cosine similarity (rows of zero norm count as cos = 0)."""
        if f_local.dim() < 2 or f_local.shape != f_global.shape or f_local.shape[0] < 1:
            raise ValueError(
                f"cosine drift needs two feature batches of one shape (B, ...), got {tuple(f_local.shape)} "
                f"and {tuple(f_global.shape)}"
            )
        xf, yf = f_local.flatten(1).to(KERNEL_DTYPE), f_global.flatten(1).to(KERNEL_DTYPE)
        cos = F.cosine_similarity(xf, yf, dim=1, eps=1e-8)
        return (1.0 - cos.mean()).to(f_local.dtype)


# --------------------------------------------------------------------------------------------------
# Features of a named layer and the refit schedule
# --------------------------------------------------------------------------------------------------


def named_layer(model: nn.Module, layer: str) -> nn.Module:
    """The sub-module called ``layer`` (a ``named_modules`` name), with a clear error listing the names."""
    modules = dict(model.named_modules())
    if layer not in modules or layer == "":
        names = [n for n in modules if n]
        raise ValueError(f"model has no layer {layer!r}; its layers are: {', '.join(names)}")
    return modules[layer]


def forward_with_layers(
    model: nn.Module, layers: Sequence[str], x: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the model's output on x, each named layer's output flattened to (B, −1)) from one forward pass.

    ``""`` means a SplitModel's encoder output: features = ``model.embed(x)``, output = ``model.head`` of them.
    Other names are ``named_modules`` names whose outputs forward hooks catch; each must run once per pass.
    """
    named = [layer for layer in layers if layer != ""]
    modules = {layer: named_layer(model, layer) for layer in named}
    caught: dict[str, list[torch.Tensor]] = {layer: [] for layer in named}
    handles = []
    for layer, module in modules.items():
        def hook(_m: nn.Module, _i: object, o: torch.Tensor, layer: str = layer) -> None:
            caught[layer].append(o)

        handles.append(module.register_forward_hook(hook))
    feats: dict[str, torch.Tensor] = {}
    try:
        if "" in layers:
            embed = getattr(model, "embed", None)
            head = getattr(model, "head", None)
            if not callable(embed) or not isinstance(head, nn.Module):
                raise ValueError("feature layer '' needs a model with embed(x) and a head (hetfed's SplitModel)")
            z = embed(x)
            out: torch.Tensor = head(z)
            feats[""] = z.flatten(1)
        else:
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    for layer in named:
        got = caught[layer]
        if len(got) != 1 or not isinstance(got[0], torch.Tensor):
            raise ValueError(f"layer {layer!r} must produce one tensor per forward pass, it produced {len(got)}")
        feats[layer] = got[0].flatten(1)
    return out, {layer: feats[layer] for layer in layers}


def forward_with_features(model: nn.Module, layer: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's output on x, the named layer's output flattened to (B, −1)) from one forward pass.

    ``layer == ""`` means a SplitModel's encoder output (see :func:`forward_with_layers`).
    """
    out, feats = forward_with_layers(model, (layer,), x)
    return out, feats[layer]


@torch.no_grad()
def gather_features(
    local: nn.Module, reference: nn.Module, layer: str, batches: Iterable[torch.Tensor], max_batches: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of both models on up to ``max_batches`` input batches, in eval mode, without gradients.

    The kernel-refit sample (§5: "updated every 20 steps using s batches"); both models' train/eval modes are
    restored afterwards.
    """
    if int(max_batches) < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    modes = (local.training, reference.training)
    local.eval()
    reference.eval()
    fl: list[torch.Tensor] = []
    fg: list[torch.Tensor] = []
    try:
        for i, xb in enumerate(batches):
            if i >= max_batches:
                break
            fl.append(forward_with_features(local, layer, xb)[1])
            fg.append(forward_with_features(reference, layer, xb)[1])
    finally:
        local.train(modes[0])
        reference.train(modes[1])
    if not fl:
        raise ValueError("gather_features got no batches")
    return torch.cat(fl), torch.cat(fg)


@dataclass(frozen=True)
class RefitSchedule:
    """When kernels are refit: every ``every`` local steps on features of ``batches`` batches, or every step (−1).

    ``every = -1`` is the paper's MK-MMD₋₁ (each step, on the current batch); ``every = 20, batches = 50`` is
    MK-MMD₂₀ and the paper's MMD-D setting. Steps count from 0 within a round, so a refit comes before steps
    0, 20, 40, … (the reference code refits after its steps 1, 21, 41, … and gathers s + 1 batches).
    """

    every: int = 20
    batches: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or (self.every != -1 and self.every < 1):
            raise ValueError(f"refit every must be -1 (each step) or a positive number of steps, got {self.every!r}")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or self.batches < 1:
            raise ValueError(f"refit batches (s) must be a positive int, got {self.batches!r}")

    @property
    def per_step(self) -> bool:
        """Whether kernels are refit on every step's own batch."""
        return self.every == -1

    def due(self, step: int) -> bool:
        """Whether a periodic refit on gathered features comes before local step ``step`` (0-based in the round)."""
        return not self.per_step and step % self.every == 0


# --------------------------------------------------------------------------------------------------
# Ditto's weight penalty, as a gradient
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def add_proximal_gradient(params: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], lam: float) -> None:
    """Add the gradient of (λ/2)·Σ‖p − r‖², that is λ·(p − r), to each parameter's ``.grad`` in place.

    Ditto's weight penalty toward the frozen global weights w̄, applied between the backward pass and the
    optimiser step: the same update as autograd through the penalty, at a fraction of the cost on small models.
    A parameter without a gradient gets λ·(p − r) as its gradient.
    """
    if lam == 0:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    torch._foreach_add_(grads, torch._foreach_sub([p.detach() for p in params], list(reference)), alpha=float(lam))
