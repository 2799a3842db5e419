"""Fed-CMA's loss terms (eq. 5): the head consensus and the class-conditional alignment, in the paper's form
and the reference code's."""

from __future__ import annotations

import torch
from torch import nn


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

    def per_example(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each latent's share of ``forward``'s sum, (λ2/2)·class_weight[y]·||g(x) - ē^y||², a tensor [n]."""
        sq = (z - self.centers[labels]).pow(2).sum(dim=1)
        return 0.5 * self.lambda2 * self.class_weight[labels].to(sq.dtype) * sq


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
