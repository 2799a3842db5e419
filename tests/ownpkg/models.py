"""Model builders as an organization writes them: plain PyTorch, hetfed's builder signature."""

from __future__ import annotations

import math

from torch import nn


def tiny_cnn(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """A small CNN with BatchNorm: 8 channels, 3x3, pooled, then a linear layer to the latent."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(8 * (h // 2) * (w // 2), latent_dim), nn.Sigmoid() if bounded_latent else nn.ReLU(),
    )


def tiny_mlp(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """Flatten, one hidden layer of 32, the latent."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU(),
                         nn.Linear(32, latent_dim), nn.Sigmoid() if bounded_latent else nn.ReLU())


tiny_mlp.latent_dim = 24  # type: ignore[attr-defined]


class WithHead(nn.Module):
    """A whole model whose head the organization chose (no bias)."""

    def __init__(self, encoder: nn.Module, latent_dim: int, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(latent_dim, num_classes, bias=False)


def whole(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool, num_classes: int) -> nn.Module:
    """A builder that returns the whole model: hetfed keeps its head."""
    return WithHead(tiny_mlp(input_shape, latent_dim, bounded_latent), latent_dim, num_classes)


def wrong_width(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """An encoder that ignores latent_dim."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), latent_dim + 3))


def unbounded(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """An encoder that ignores bounded_latent."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), latent_dim))


def raises(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """A builder that fails."""
    raise RuntimeError("no GPU-only layer here")


def not_a_module(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> object:
    """A builder that returns something else."""
    return {"layers": 3}


def frozen_head(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool, num_classes: int) -> nn.Module:
    """A whole model whose head the organization froze (head-only FedAvg cannot average it)."""
    model = whole(input_shape, latent_dim, bounded_latent, num_classes)
    model.head.requires_grad_(False)
    return model
