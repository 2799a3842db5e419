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


MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry("hetfed.client.models:mlp", 64, "MLP: flatten, Linear(in, 200), ReLU, Linear(200, d_e)"),
    "mlp1": ModelEntry("hetfed.client.models:mlp1", 256,
                       "one hidden layer: flatten, Linear(in, d_e), ReLU (d_e = 1258 on 28x28: 1.0M parameters)"),
    "lenet": ModelEntry("hetfed.client.models:lenet", 84, "LeNet-5 style CNN (6 and 16 channels, 120 hidden)"),
    "lenet_wide": ModelEntry("hetfed.client.models:lenet_wide", 84, "LeNet with 12 and 32 channels, 200 hidden"),
    "fedgen_cnn": ModelEntry("hetfed.client.models:fedgen_cnn", 32,
                             "FedGen's MNIST CNN (two stride-2 3x3 convolutions with BatchNorm)"),
    "cnn_small": ModelEntry("hetfed.client.models:cnn_small", 60,
                            "two 3x3 convolutions (16, 32) with max-pooling, d_e = 60 (100k parameters on 28x28)"),
    "cnn": ModelEntry("hetfed.client.models:cnn", 128, "two 3x3 convolutions (32, 64) with max-pooling"),
    "rmnist_cnn": ModelEntry("hetfed.client.models:rmnist_cnn", 64,
                             "Rotated MNIST network of DIVA/DIRT/FedSR: two bias-free 3x3 convolutions (32, 64) with "
                             "BatchNorm and max-pooling, Linear(1600, d_e), no activation on z"),
    "rmnist_cnn_k5": ModelEntry("hetfed.client.models:rmnist_cnn_k5", 64,
                                "rmnist_cnn with DIVA/DIRT's 5x5 convolutions (Linear(1024, d_e))"),
    "linear": ModelEntry("hetfed.client.models:linear", 20,
                         "one Linear(in, d_e), no activation: with the head, the Ditto paper's Synthetic network"),
    "resnet18": ModelEntry("hetfed.client.models:resnet18", 128, "torchvision ResNet-18 (GPU client image)",
                           vision=True),
    "mobilenet_v2": ModelEntry("hetfed.client.models:mobilenet_v2", 128,
                               "torchvision MobileNetV2 (GPU client image)", vision=True),
}
