"""Loss terms as small modules with their own numeric tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class ProximalTerm(nn.Module):
    """FedProx's (mu/2)·Σ||w - w_ref||² over the trainable parameters (Li et al. 2020, eq. 2)."""

    def __init__(self, mu: float, reference: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.mu = mu
        self.reference = [r.detach().clone() for r in reference]

    def forward(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The proximal penalty of ``params`` against the reference weights."""
        total = params[0].new_zeros(())
        for p, r in zip(params, self.reference, strict=True):
            total = total + (p - r).pow(2).sum()
        return 0.5 * self.mu * total


class HeadConsensusTerm(nn.Module):
    """Fed-CMA's head consensus (λ1/2)·p_i·||v_i - v̄||² over the head's weight and bias (eq. 5).

    The reference code's form is λ1·||v_i - v̄||² (no 1/2, no p_i): pass ``scale = λ1`` instead of
    ``λ1·p_i/2``. v̄ is a constant: it is detached and never receives a gradient.
    """

    def __init__(self, scale: float, weight_ref: torch.Tensor, bias_ref: torch.Tensor) -> None:
        super().__init__()
        self.scale = float(scale)
        self.weight_ref = weight_ref.detach().clone()
        self.bias_ref = bias_ref.detach().clone()

    def forward(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """scale · (||W - W̄||² + ||b - b̄||²)."""
        return self.scale * ((weight - self.weight_ref).pow(2).sum() + (bias - self.bias_ref).pow(2).sum())


class ClassMeanAlignment(nn.Module):
    """Fed-CMA's alignment (λ2/2)·Σ_k (p_i^k / b_i^k)·Σ_{x∈B_i^k} ||g(x) - ē^k||² (eq. 5, the paper's form).

    ``z`` holds the latents of the fixed per-class batches and ``labels`` their classes; ``class_weight[k]``
    is p_i^k / b_i^k and ``active[k]`` says whether ē^k has been set (inactive classes contribute nothing).
    ē is a constant: it is detached and never receives a gradient.
    """

    def __init__(self, lambda2: float, centers: torch.Tensor, class_weight: torch.Tensor,
                 active: torch.Tensor) -> None:
        super().__init__()
        self.lambda2 = float(lambda2)
        self.centers = centers.detach().clone()
        self.class_weight = (class_weight.detach() * active.to(class_weight.dtype)).clone()

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The weighted sum of squared distances of each latent to its class's global mean, times λ2/2."""
        sq = (z - self.centers[labels]).pow(2).sum(dim=1)
        return 0.5 * self.lambda2 * (self.class_weight[labels].to(sq.dtype) * sq).sum()


class BatchMeanSquaredAlignment(nn.Module):
    """The reference code's alignment: λ2·Σ_{k in the batch, ē^k set} mean_{x of class k, dims} (g(x) - ē^k)².

    (ajavvadi/FedCMA-ktboi: code/worker.py, ``MSELoss(reduction='mean')`` per class of the current
    training batch, no p weights.) ē is a constant and never receives a gradient.
    """

    def __init__(self, lambda2: float, centers: torch.Tensor, active: torch.Tensor) -> None:
        super().__init__()
        self.lambda2 = float(lambda2)
        self.centers = centers.detach().clone()
        self.active = active.detach().clone().to(torch.bool)

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """λ2 times the sum over the batch's active classes of the per-class mean squared error."""
        total = z.new_zeros(())
        for k in torch.unique(labels).tolist():
            if not bool(self.active[k]):
                continue
            rows = z[labels == k]
            total = total + (rows - self.centers[k]).pow(2).mean()
        return self.lambda2 * total


class ConfidenceWeightedDistillation(nn.Module):
    """FedH2L's mutual-learning loss ℓ_KL + ℓ_CE over the teachers' seed batches (Li et al., eqs. 3-5).

    ℓ_KL = (1/T)·Σ_j Acc_j·KL(p_j ‖ softmax(z_j)) with KL averaged over the batch and the teacher's
    posteriors p_j constant; ℓ_CE = (1/T)·Σ_j CE(z_j, y_j), left out for unlabelled seed data. T is the
    number of teachers (N - 1 when every peer teaches). A teacher with Acc_j = 0 adds nothing to ℓ_KL.
    """

    def __init__(self, labelled: bool = True) -> None:
        super().__init__()
        self.labelled = labelled

    def forward(self, logits: list[torch.Tensor], teacher_probs: list[torch.Tensor], confidences: list[float],
                labels: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ℓ_KL + ℓ_CE, ℓ_KL, ℓ_CE) of the student's logits on each teacher's batch."""
        if not logits or len(teacher_probs) != len(logits) or len(confidences) != len(logits):
            raise ValueError("one logits batch, one posterior batch and one confidence per teacher are needed")
        t = len(logits)
        kl = logits[0].new_zeros(())
        ce = logits[0].new_zeros(())
        for j, (z, p) in enumerate(zip(logits, teacher_probs, strict=True)):
            p = p.detach().to(z.dtype)
            log_q = torch.log_softmax(z, dim=1)
            kl_j = (torch.xlogy(p, p) - p * log_q).sum(dim=1).mean()
            kl = kl + float(confidences[j]) * kl_j
            if self.labelled:
                if labels is None:
                    raise ValueError("labelled distillation needs the seed batches' labels")
                ce = ce + F.cross_entropy(z, labels[j])
        kl, ce = kl / t, ce / t
        return kl + ce, kl, ce


class ConflictProjection(nn.Module):
    """FedH2L's projection of g_pub against g_loc (eqs. 7-14): the closed form of the dual QP.

    v* = max(0, -⟨g_pub, g_loc⟩ / ‖g_loc‖²) and g̃ = g_pub + v*·g_loc, the gradient closest to g_pub (in ℓ2)
    with ⟨g̃, g_loc⟩ ≥ 0. Dot products are taken in float64; when the gradients do not conflict g̃ = g_pub.
    """

    def forward(self, g_pub: torch.Tensor, g_loc: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(g̃, v*) for flat gradient vectors."""
        if g_pub.shape != g_loc.shape or g_pub.dim() != 1:
            raise ValueError(f"flat gradients of equal length needed, got {tuple(g_pub.shape)} and {tuple(g_loc.shape)}")
        g_loc64 = g_loc.double()
        dot = float(torch.dot(g_pub.double(), g_loc64))
        if dot >= 0:
            return g_pub, 0.0
        v = -dot / float(torch.dot(g_loc64, g_loc64))  # dot < 0 implies ‖g_loc‖ > 0
        return (g_pub.double() + v * g_loc64).to(g_pub.dtype), v


def flat_grad(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients as one flat vector; a parameter without a gradient contributes zeros."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def assign_flat_grad(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Set each parameter's gradient from the matching slice of a flat vector (the inverse of flat_grad)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} elements, the parameters {offset}")
