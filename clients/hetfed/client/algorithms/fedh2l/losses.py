"""FedH2L's loss terms: confidence-weighted mutual distillation (eqs. 3-5) and the gradient projection
(eqs. 7-14)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


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
