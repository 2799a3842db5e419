"""Fine-tuning a frozen "pretrained" backbone with LoRA adapters: two hetfed builders in plain PyTorch.

``lora_cnn`` is what an organization fine-tuning a pretrained network writes: the backbone's weights are fixed
and frozen (``requires_grad`` False), each of its ``nn.Linear`` layers gets a trainable low-rank update
``(alpha / r) · B A x`` (LoRA, Hu et al. 2021), and hetfed adds the new classifier head. Under the FedAvg
family and Ditto only what trains crosses the wire: the adapters and the head. The backbone's weights and its
BatchNorm running statistics stay in the organization (docs/models.md, "Frozen tensors").

``full_cnn`` is the same backbone with every tensor trainable and no adapters: the whole model, which FedAvg
sends whole. The two side by side give the bytes a round saves.

Nothing downloads: the "pretrained" weights come from a fixed seed (``PRETRAINED_SEED``), the same in every
organization and every run, as a checkpoint in the client image would be (``torch.load`` in its place). The
adapters' A matrices come from the run's seed (hetfed seeds the builder), so every organization starts from the
same model; B starts at zero, so the encoder starts as the pretrained backbone exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["FEATURES", "PRETRAINED_SEED", "RANK", "LoRALinear", "full_cnn", "lora_cnn"]

PRETRAINED_SEED = 7
"""The seed of the stand-in pretrained weights (the same whatever the run's seed)."""

FEATURES = 128
"""The backbone's feature width: the latent z hetfed's head reads."""

RANK = 4
"""The adapters' rank r."""


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-r update: y = base(x) + (alpha / r) · x Aᵀ Bᵀ."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        # A: Gaussian of variance 1/in (from the caller's RNG: hetfed's run seed); B: zero, so y = base(x) at start.
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = (alpha if alpha is not None else 2.0 * rank) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus the low-rank update."""
        out: torch.Tensor = self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale
        return out


def _pretrained(input_shape: tuple[int, ...], latent_dim: int, bounded: bool, name: str) -> nn.Sequential:
    """The backbone, its weights fixed by ``PRETRAINED_SEED`` (the caller's RNG state is left as it was)."""
    if len(input_shape) != 3 or min(input_shape) < 1 or min(input_shape[1:]) < 4:
        raise ValueError(f"{name} needs an image input (C, H, W) of at least 4x4 pixels, got {tuple(input_shape)}")
    if latent_dim != FEATURES:
        raise ValueError(f"{name}: the pretrained backbone's features are {FEATURES} wide, the run asks for "
                         f"latent_dim {latent_dim} (leave latent_dim unset)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(PRETRAINED_SEED)
        return nn.Sequential(
            nn.Conv2d(input_shape[0], 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            nn.Linear(64 * 16, 512), nn.ReLU(),
            nn.Linear(512, FEATURES), nn.Sigmoid() if bounded else nn.ReLU(),
        )


def lora_cnn(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """The frozen backbone with a rank-``RANK`` adapter on each of its linear layers (hetfed adds the head)."""
    net = _pretrained(input_shape, latent_dim, bounded_latent, "lora_cnn").requires_grad_(False)
    for i, layer in enumerate(net):
        if isinstance(layer, nn.Linear):
            net[i] = LoRALinear(layer, RANK)
    return net


def full_cnn(input_shape: tuple[int, ...], latent_dim: int, bounded_latent: bool) -> nn.Module:
    """The same backbone, every tensor trainable, no adapters: the whole model fine-tuned."""
    return _pretrained(input_shape, latent_dim, bounded_latent, "full_cnn")


lora_cnn.latent_dim = FEATURES  # type: ignore[attr-defined]
full_cnn.latent_dim = FEATURES  # type: ignore[attr-defined]
