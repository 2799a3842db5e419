"""Pieces every kernel drift measure of Ditto shares: the float64 kernel dtype, the paper's bandwidths, RBF maps.

Numeric type: by default every kernel computation runs in float64 (:data:`KERNEL_DTYPE`). Features are cast on
entry and each loss comes back in the dtype of its input features, so the gradient still reaches a float32
model. An MMD² estimate is a difference of kernel sums of order one that nearly cancel while the personal model
is close to the frozen global one (estimates of 1e-6 and below are common early in a round), and Q̂ is built
from products of such differences; float32 leaves two or three significant digits there. The MMD-D kernel's
own parameters follow the same dtype. The reference code (FL4Health) computes in torch's default float32; the
MK-MMD and MMD-D modules take a ``dtype`` for it (the config's ``kernel_dtype``), which roughly halves the
memory traffic of a 1,000-row refit.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

KERNEL_DTYPE = torch.float64
"""The default dtype of the kernel maths here (see the module docstring)."""
KERNEL_DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32}
"""The kernel dtypes a config may name (``kernel_dtype``)."""
BandwidthForm = Literal["rate", "scale"]
MmdEstimator = Literal["unbiased", "biased"]
BANDWIDTH_FORMS: tuple[str, ...] = ("rate", "scale")
ESTIMATORS: tuple[str, ...] = ("unbiased", "biased")


def paper_gammas(dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
    """The RBF parameters γ_j = 2^p for p = −3.5, −3.25, …, 1: 19 values (in float64 unless ``dtype``).

    The paper (§3.3, Appendix C) names this grid and also says d = 18; the grid from −3.5 to 1 in steps of 0.25
    holds 19 points, and the reference code builds the same 19 (``arange(-3.5, 1.25, 0.25)``), so 19 are used.
    """
    return torch.pow(2.0, torch.arange(-14, 5, dtype=torch.float64) / 4.0).to(dtype)


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances ‖x_i − y_k‖² of two row sets (n×m), clamped at 0 against rounding."""
    xx = (x * x).sum(dim=1, keepdim=True)
    yy = (y * y).sum(dim=1, keepdim=True)
    return (xx + yy.transpose(0, 1) - 2.0 * (x @ y.transpose(0, 1))).clamp_min(0.0)


_SQUARING_MIN_ELEMENTS = 4096
"""Distance arrays at least this large take the squaring path of :func:`rbf` (smaller ones: one exp call)."""


def doubling_period(rates: torch.Tensor) -> int:
    """The p with r[j + p] = 2·r[j] for the rates r in ascending order (to 1e-12), or 0: then k_{j+p} = k_j²."""
    r = sorted(rates.detach().cpu().tolist())
    for p in range(1, len(r)):
        if all(abs(r[j + p] - 2.0 * r[j]) <= 1e-12 * r[j + p] for j in range(len(r) - p)):
            return p
    return 0


def rbf(sq: torch.Tensor, gammas: torch.Tensor, form: BandwidthForm) -> torch.Tensor:
    """exp(−rate_j·sq) for every kernel j, stacked (d, ...sq): rate γ_j ("rate") or 1/γ_j ("scale").

    On a large ``sq`` whose rates double every p kernels in ascending order (the paper's 2^{p/4} grid: p = 4),
    only the p smallest rates call exp and each other kernel is the square of the one whose rate is half its
    own (exp(−2a) = exp(−a)²): the same values to a few ulp, at a fraction of the cost (profiled:
    exp was most of a 500-row refit). Not on a graph: the in-place writes are gradient-free.
    """
    rates = gammas if form == "rate" else 1.0 / gammas
    differentiable = torch.is_grad_enabled() and (sq.requires_grad or rates.requires_grad)
    period = doubling_period(rates) if sq.numel() >= _SQUARING_MIN_ELEMENTS and not differentiable else 0
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
def as_feature_pair(x: torch.Tensor, y: torch.Tensor, what: str,
                    dtype: torch.dtype = KERNEL_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten both samples to (n, features) in ``dtype``, checking they are same-size with n ≥ 2."""
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
    return xf.to(dtype), yf.to(dtype)


def check_kernel_dtype(what: str, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or a clear ValueError unless it is one of :data:`KERNEL_DTYPES`."""
    if dtype not in KERNEL_DTYPES.values():
        raise ValueError(f"{what} dtype must be torch.float64 or torch.float32, got {dtype}")
    return dtype


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise a clear ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def check_positive(name: str, value: float) -> float:
    """``value`` as a float, or a clear ValueError unless it is finite and positive."""
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v
