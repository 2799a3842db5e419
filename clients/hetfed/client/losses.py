"""Loss terms as small modules with their own numeric tests."""

from __future__ import annotations

import torch
from torch import nn


class ProximalTerm(nn.Module):
    """FedProx's (mu/2)·Σ||w - w_ref||² over the trainable parameters (Li et al. 2020, eq. 2)."""

    def __init__(self, mu: float, reference: list[torch.Tensor]) -> None:
        super().__init__()
        self.mu = mu
        self.reference = [r.detach().clone() for r in reference]

    def forward(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The proximal penalty of ``params`` against the reference weights."""
        total = params[0].new_zeros(())
        for p, r in zip(params, self.reference, strict=True):
            total = total + (p - r).pow(2).sum()
        return 0.5 * self.mu * total
