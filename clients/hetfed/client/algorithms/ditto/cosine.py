"""The cosine baseline drift measure of Ditto's paper: one minus the mean cosine of paired features."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.ditto.kernels import KERNEL_DTYPE


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
