"""Loss terms shared by several algorithms, as small modules with their own numeric tests.

An algorithm's own terms live beside it (``hetfed.client.algorithms.<name>.losses``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


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
