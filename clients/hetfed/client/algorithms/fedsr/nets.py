"""FedSR's Rotated MNIST representation network (§4.2): two 3×3 convolutions and a fully connected layer to z.

The paper: "a network of two 3x3 convolutional layers and a fully connected layer as the representation
network g to get a representation z of 64 dimensions ... the same as the network used by [15, 31]"
(DIVA, DIRT). Those works' code (atuannguyen/DIRT: domain_gen_rotatedmnist/models/deepall.py) gives the
rest: Conv(1→32, bias-free) → BatchNorm → ReLU → MaxPool 2, Conv(32→64, bias-free) → BatchNorm → ReLU →
MaxPool 2, then Linear(flat → z), no activation on z; but its convolutions are 5×5 (28 → 24 → 12 → 8 → 4,
flat 1024), not the 3×3 the FedSR text says. The paper's 3×3 is the default here (28 → 26 → 13 → 11 → 5,
flat 1600); ``kernel_size=5`` gives DIVA/DIRT's network. The deterministic encoder (FedAvg, FedL2R) is
the whole network; :func:`hetfed.client.algorithms.fedsr.losses.build_probabilistic_model` replaces its
final Linear by Linear(flat → 2·z) for the probabilistic one (FedCMI, FedSR).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMNIST_LATENT_DIM", "rmnist_cnn", "rmnist_cnn_k5", "rmnist_trunk"]

RMNIST_LATENT_DIM = 64
"""z = 64 dimensions for Rotated MNIST (§4.2)."""


def rmnist_trunk(input_shape: tuple[int, ...], *, kernel_size: int = 3) -> tuple[nn.Sequential, int]:
    """The two convolution blocks and the flatten, with the flat width they produce on ``input_shape``."""
    min_side = 3 * kernel_size + 1  # the second pooling still sees 2 × 2 pixels
    if len(input_shape) != 3 or input_shape[0] < 1 or min(input_shape[1:]) < min_side:
        raise ValueError(f"model 'rmnist_cnn' with {kernel_size}x{kernel_size} convolutions needs an image "
                         f"input shape (C, H, W) of at least 1 channel and {min_side}x{min_side} pixels, "
                         f"got {input_shape}")
    c = int(input_shape[0])
    trunk = nn.Sequential(
        nn.Conv2d(c, 32, kernel_size=kernel_size, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=kernel_size, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    with torch.no_grad():
        was_training = trunk.training
        trunk.eval()
        flat = int(trunk(torch.zeros(1, *input_shape)).numel())
        trunk.train(was_training)
    return trunk, flat


def _rmnist(input_shape: tuple[int, ...], latent_dim: int, bounded: bool, kernel_size: int) -> nn.Module:
    trunk, flat = rmnist_trunk(input_shape, kernel_size=kernel_size)
    layers: list[nn.Module] = [*trunk, nn.Linear(flat, latent_dim)]
    if bounded:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


def rmnist_cnn(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """Encoder builder: the paper's network (3×3 convolutions), ending in a bare Linear(1600 → latent_dim)."""
    return _rmnist(input_shape, latent_dim, bounded, kernel_size=3)


def rmnist_cnn_k5(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """Encoder builder: DIVA/DIRT's network (5×5 convolutions), ending in a bare Linear(1024 → latent_dim)."""
    return _rmnist(input_shape, latent_dim, bounded, kernel_size=5)
