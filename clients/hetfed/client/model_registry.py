"""The architectures an organization can pick by name, as data (builders referenced lazily, no torch import).

Each entry names its encoder builder ``(input_shape, latent_dim, bounded_latent) -> nn.Module`` as
``"module:function"`` and its default latent width; :func:`hetfed.client.models.build_model` resolves it.
Adding an architecture adds its builder and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    """A registered architecture: its encoder builder, default latent width and what it is."""

    builder: str
    latent_dim: int
    summary: str
    # Needs torchvision (imported lazily, with a clear error where it is missing).
    vision: bool = False
    # 0: takes any input (flattened); else needs images (C, H, W) at least this many pixels on each side.
    min_image_side: int = 0


MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry("hetfed.client.models:mlp", 64, "MLP: flatten, Linear(in, 200), ReLU, Linear(200, d_e)"),
    "mlp1": ModelEntry("hetfed.client.models:mlp1", 256,
                       "one hidden layer: flatten, Linear(in, d_e), ReLU (d_e = 1258 on 28x28: 1.0M parameters)"),
    "lenet": ModelEntry("hetfed.client.models:lenet", 84, "LeNet-5 style CNN (6 and 16 channels, 120 hidden)",
                        min_image_side=4),
    "lenet_wide": ModelEntry("hetfed.client.models:lenet_wide", 84, "LeNet with 12 and 32 channels, 200 hidden",
                             min_image_side=4),
    "fedgen_cnn": ModelEntry("hetfed.client.models:fedgen_cnn", 32,
                             "FedGen's MNIST CNN (two stride-2 3x3 convolutions with BatchNorm)", min_image_side=4),
    "cnn_small": ModelEntry("hetfed.client.models:cnn_small", 60,
                            "two 3x3 convolutions (16, 32) with max-pooling, d_e = 60 (100k parameters on 28x28)",
                            min_image_side=4),
    "cnn": ModelEntry("hetfed.client.models:cnn", 128, "two 3x3 convolutions (32, 64) with max-pooling",
                      min_image_side=4),
    "rmnist_cnn": ModelEntry("hetfed.client.models:rmnist_cnn", 64,
                             "Rotated MNIST network of DIVA/DIRT/FedSR: two bias-free 3x3 convolutions (32, 64) with "
                             "BatchNorm and max-pooling, Linear(1600, d_e), no activation on z", min_image_side=10),
    "rmnist_cnn_k5": ModelEntry("hetfed.client.models:rmnist_cnn_k5", 64,
                                "rmnist_cnn with DIVA/DIRT's 5x5 convolutions (Linear(1024, d_e))", min_image_side=16),
    "rmnist_dirt": ModelEntry("hetfed.client.models:rmnist_dirt", 64,
                              "DIRT's own network: rmnist_cnn_k5 with Xavier initialisation and a ReLU before the "
                              "classifier (head(relu(z)))", min_image_side=16),
    "linear": ModelEntry("hetfed.client.models:linear", 20,
                         "one Linear(in, d_e), no activation: with the head, the Ditto paper's Synthetic network"),
    "resnet18": ModelEntry("hetfed.client.models:resnet18", 128, "torchvision ResNet-18 (GPU client image)",
                           vision=True, min_image_side=8),
    "mobilenet_v2": ModelEntry("hetfed.client.models:mobilenet_v2", 128,
                               "torchvision MobileNetV2 (GPU client image)", vision=True,
                               min_image_side=8),
}


DEFAULT_MODEL = "lenet"
"""The architecture of an organization that names none."""


def is_reference(model: str) -> bool:
    """Whether ``model`` names an organization's own builder (``"package.module:function"``), not a built-in."""
    return ":" in model


def input_mismatch(model: str, input_shape: tuple[int, ...]) -> str | None:
    """Why ``model`` cannot take inputs of ``input_shape`` (one line), or None when it can; needs no torch."""
    if not input_shape or any(d < 1 for d in input_shape):
        return f"model {model!r} needs inputs of at least one feature, got inputs of shape {input_shape}"
    side = MODELS[model].min_image_side
    if side == 0:
        return None
    if len(input_shape) != 3:
        return f"model {model!r} needs images (C, H, W), got inputs of shape {input_shape}"
    if min(input_shape[1:]) < side:
        return f"model {model!r} needs images of at least {side}x{side} pixels, got {input_shape}"
    return None


def models_for(input_shape: tuple[int, ...]) -> list[str]:
    """The registered models that take inputs of ``input_shape``."""
    return [name for name in MODELS if input_mismatch(name, input_shape) is None]
