"""Three encoders in plain PyTorch, each behind a hetfed builder ``builder(input_shape, latent_dim, bounded_latent)``.

A builder returns an ENCODER mapping a batch ``(B, C, H, W)`` to ``(B, latent_dim)``; hetfed adds the linear
head and whatever its algorithm needs (SimFed factorises every nn.Linear and nn.Conv2d, FedSR widens the final
projection, Fed-CMA passes ``bounded_latent=True`` and gets a Sigmoid at the end). Every encoder here ends with
``Linear(..., latent_dim)`` followed by Sigmoid when the latent must be bounded, else ReLU. Each is sized for
small grey images (40-90k parameters and 1-3 million multiply-adds on 1x28x28), so a federation of them
trains on a laptop CPU.

- ``resnet``: a small ResNet (stride-2 stem, three basic blocks with BatchNorm, average-pooled to 2x2);
- ``dsconv``: a depthwise-separable CNN (3x3 depthwise Conv2d(groups=C) then a pointwise 1x1, MobileNet style);
- ``mixer``: an MLP-Mixer (patches by a strided Conv2d, token- and channel-mixing MLPs with LayerNorm, the
  mean token).

The CNNs pool to 2x2 rather than 1x1: on a few hundred images they learn markedly faster when the latent
projection still sees where in the image a feature is.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["dsconv", "mixer", "resnet"]

LATENT_DIM = 64
"""The latent width every builder here declares (``builder.latent_dim``), the same for all three so that they
federate in one latent space when the run sets none."""


def _image_shape(name: str, input_shape: tuple[int, ...], min_side: int) -> tuple[int, int, int]:
    """(C, H, W) of ``input_shape``; a ValueError naming the builder when it is not an image this large."""
    if len(input_shape) != 3 or input_shape[0] < 1 or min(input_shape[1:]) < min_side:
        raise ValueError(f"{name} needs an image input (C, H, W) with C >= 1 and H, W >= {min_side}, "
                         f"got {tuple(input_shape)}")
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def _to_latent(width: int, latent_dim: int, bounded: bool) -> list[nn.Module]:
    """The end every encoder shares: Linear to the latent, then Sigmoid (bounded, in [0, 1]) or ReLU."""
    return [nn.Linear(width, latent_dim), nn.Sigmoid() if bounded else nn.ReLU()]


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, added to a (projected) shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output, of ``cout`` channels at 1/stride the resolution."""
        out: torch.Tensor = self.relu(self.body(x) + self.shortcut(x))
        return out


def resnet(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """A small ResNet: stride-2 3x3 stem (16), basic blocks 16, 32 (stride 2), 64 (stride 2), pooled to 2x2."""
    c, _, _ = _image_shape("resnet", input_shape, min_side=8)
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16, stride=1),
        BasicBlock(16, 32, stride=2),
        BasicBlock(32, 64, stride=2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        *_to_latent(64 * 4, latent_dim, bounded_latent),
    )


resnet.latent_dim = LATENT_DIM  # type: ignore[attr-defined]


def _separable(cin: int, cout: int, stride: int) -> list[nn.Module]:
    """A depthwise 3x3 convolution (one filter per channel, groups=cin) then a pointwise 1x1, each with BN, ReLU."""
    return [
        nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),
        nn.BatchNorm2d(cin),
        nn.ReLU(),
        nn.Conv2d(cin, cout, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    ]


def dsconv(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """A depthwise-separable CNN: stride-2 3x3 stem (32), separable blocks 64, 128 (stride 2), 128 (stride 2),
    pooled to 2x2."""
    c, _, _ = _image_shape("dsconv", input_shape, min_side=8)
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        *_separable(32, 64, stride=1),
        *_separable(64, 128, stride=2),
        *_separable(128, 128, stride=2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        *_to_latent(128 * 4, latent_dim, bounded_latent),
    )


dsconv.latent_dim = LATENT_DIM  # type: ignore[attr-defined]


class MixerBlock(nn.Module):
    """One MLP-Mixer layer on (B, tokens, dim): a token-mixing MLP across patches, then a channel-mixing MLP,
    each after a LayerNorm and added back to its input."""

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.tokens = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channels = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mixed tokens, same shape as ``x``."""
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        out: torch.Tensor = x + self.channels(self.norm2(x))
        return out


class Patches(nn.Module):
    """Non-overlapping ``patch`` x ``patch`` patches embedded to ``dim`` by a strided Conv2d, as (B, tokens, dim)."""

    def __init__(self, channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, (H // patch) * (W // patch), dim)."""
        out: torch.Tensor = self.embed(x).flatten(2).transpose(1, 2)
        return out


class TokenMean(nn.Module):
    """Global average pooling over the tokens: (B, tokens, dim) -> (B, dim)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mean token."""
        return x.mean(dim=1)


def mixer(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """An MLP-Mixer: square patches a quarter of the shorter side (7x7 on 28x28: 16 tokens) embedded to 64,
    two mixer blocks (token MLP 32, channel MLP 128), LayerNorm and the mean token."""
    c, h, w = _image_shape("mixer", input_shape, min_side=8)
    patch, dim = min(h, w) // 4, 64
    tokens = (h // patch) * (w // patch)
    return nn.Sequential(
        Patches(c, dim, patch),
        MixerBlock(tokens, dim, token_hidden=32, channel_hidden=128),
        MixerBlock(tokens, dim, token_hidden=32, channel_hidden=128),
        nn.LayerNorm(dim),
        TokenMean(),
        *_to_latent(dim, latent_dim, bounded_latent),
    )


mixer.latent_dim = LATENT_DIM  # type: ignore[attr-defined]
