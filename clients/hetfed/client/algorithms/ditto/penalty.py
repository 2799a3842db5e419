"""Ditto's weight penalty (λ/2)·‖w_L − w̄‖², added as a gradient before the personal model's step."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
