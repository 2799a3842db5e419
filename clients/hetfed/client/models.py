"""Private client models: an encoder to a flat latent z and a linear head, built deterministically by name."""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from types import ModuleType

import numpy as np
import torch
from torch import nn

from hetfed.client.model_registry import MODELS, is_reference
from hetfed.client.training import eval_mode

__all__ = [
    "OWN_LATENT_DIM",
    "ModelBuilderError",
    "ModelUnavailableError",
    "ReLULinear",
    "SplitModel",
    "available_models",
    "build_model",
    "count_parameters",
    "default_latent_dim",
    "encoder_builder",
    "is_reference",
    "load_state_arrays",
    "make_built",
    "make_encoder",
    "split_whole",
    "state_arrays",
]


class ModelUnavailableError(RuntimeError):
    """A model's optional dependency (torchvision) cannot be imported here."""


class SplitModel(nn.Module):
    """An encoder mapping inputs to a flat latent of width ``latent_dim`` and a linear classifier head on it."""

    def __init__(self, encoder: nn.Module, latent_dim: int, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.latent_dim = int(latent_dim)
        self.num_classes = int(num_classes)
        self.head = nn.Linear(self.latent_dim, self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, num_classes)."""
        logits: torch.Tensor = self.head(self.encoder(x))
        return logits

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Latent z of shape (B, latent_dim)."""
        z: torch.Tensor = self.encoder(x)
        return z


EncoderBuilder = Callable[[tuple[int, ...], int, bool], nn.Module]
"""(input_shape, latent_dim, bounded_latent) -> encoder producing (B, latent_dim)."""


def _latent_activation(bounded: bool) -> nn.Module:
    return nn.Sigmoid() if bounded else nn.ReLU()


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) of ``input_shape``, checked against the registry's least image side for model ``name``."""
    min_side = MODELS[name].min_image_side
    if len(input_shape) != 3:
        raise ValueError(f"model {name!r} needs an image input shape (C, H, W), got {input_shape}")
    c, h, w = input_shape
    if c < 1 or h < min_side or w < min_side:
        raise ValueError(
            f"model {name!r} needs at least 1 channel and {min_side}x{min_side} pixels, got {input_shape}"
        )
    return c, h, w


def _flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    with torch.no_grad(), eval_mode(features):
        out = features(torch.zeros(1, *input_shape))
    return int(out.numel())


def mlp(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """MLP encoder: flatten, Linear(in, 200), ReLU, Linear(200, d_e), then the latent activation."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 200),
        nn.ReLU(),
        nn.Linear(200, latent_dim),
        _latent_activation(bounded),
    )


def mlp1(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """One-hidden-layer MLP encoder: flatten, Linear(in, d_e), then the latent activation (the head is the output)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), latent_dim), _latent_activation(bounded))


def linear(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """One linear layer from the flattened input to d_e, no activation (a sigmoid only when bounded).

    With the SplitModel's head Linear(d_e, K) this is the Ditto+MMD paper's Synthetic network,
    Linear(60, 20) → Linear(20, 10) (its reference code has no activation between the two layers), and the
    latent z (the encoder's output) is that network's first layer.
    """
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(math.prod(input_shape), latent_dim)]
    if bounded:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


def _lenet(name: str, widths: tuple[int, int, int], input_shape: tuple[int, ...], latent_dim: int,
           bounded: bool) -> nn.Module:
    """LeNet of ``widths`` (the two 5x5 convolutions' channels and the hidden units), each convolution with ReLU
    and 2x2 max-pooling, then Linear to d_e."""
    c, _, _ = _image_shape(name, input_shape)
    conv1, conv2, hidden = widths
    features = nn.Sequential(
        nn.Conv2d(c, conv1, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(conv1, conv2, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_size(features, input_shape)
    return nn.Sequential(
        *features,
        nn.Linear(flat, hidden),
        nn.ReLU(),
        nn.Linear(hidden, latent_dim),
        _latent_activation(bounded),
    )


def lenet(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """LeNet-5 style encoder: two 5x5 convolutions (6, 16 channels) with max-pooling, then 120 hidden units."""
    return _lenet("lenet", (6, 16, 120), input_shape, latent_dim, bounded)


def lenet_wide(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """LeNet with twice the channels (12, 32) and 200 hidden units."""
    # For heterogeneous federations that mix architectures of one family at different sizes.
    return _lenet("lenet_wide", (12, 32, 200), input_shape, latent_dim, bounded)


def fedgen_cnn(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """FedGen's MNIST CNN: two stride-2 3x3 convolutions with BatchNorm and ReLU, a linear layer to d_e."""
    # FedGen's 'mnist' config (zhuangdizhu/FedGen: utils/model_config.py, FLAlgorithms/trainmodel/models.py):
    # [6, 16, 'F'] with 3x3 stride-2 padding-1 convolutions, each followed by BatchNorm and ReLU, then a
    # linear layer to the latent (784 -> 32 on 28x28); the latent has no activation in FedGen.
    c, _, _ = _image_shape("fedgen_cnn", input_shape)
    features = nn.Sequential(
        nn.Conv2d(c, 6, kernel_size=3, stride=2, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 16, kernel_size=3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
    )
    flat = _flat_size(features, input_shape)
    layers: list[nn.Module] = [*features, nn.Linear(flat, latent_dim)]
    if bounded:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


def _two_conv(name: str, widths: tuple[int, int], input_shape: tuple[int, ...], latent_dim: int,
              bounded: bool) -> nn.Module:
    """Two 3x3 convolutions of ``widths`` channels, each with ReLU and 2x2 max-pooling, then a linear layer to d_e."""
    c, _, _ = _image_shape(name, input_shape)
    features = nn.Sequential(
        nn.Conv2d(c, widths[0], kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(widths[0], widths[1], kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_size(features, input_shape)
    return nn.Sequential(*features, nn.Linear(flat, latent_dim), _latent_activation(bounded))


def cnn_small(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """Two 3x3 convolutions (16, 32 channels) with max-pooling and a linear layer to d_e (about 100k parameters
    with d_e = 60 on 28x28 images)."""
    return _two_conv("cnn_small", (16, 32), input_shape, latent_dim, bounded)


def cnn(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """Two 3x3 convolutions (32, 64 channels) with max-pooling and a linear layer to d_e."""
    return _two_conv("cnn", (32, 64), input_shape, latent_dim, bounded)


# The Rotated MNIST network of DIVA, DIRT and FedSR (§4.2: "two 3x3 convolutional layers and a fully connected
# layer ... z of 64 dimensions ... the same as the network used by [15, 31]"). DIRT's code
# (atuannguyen/DIRT: domain_gen_rotatedmnist/models/deepall.py) gives the rest: Conv(1→32, bias-free) →
# BatchNorm → ReLU → MaxPool 2, Conv(32→64, bias-free) → BatchNorm → ReLU → MaxPool 2, then Linear(flat → z)
# with no activation on z; but its convolutions are 5×5 (flat 1024), not the 3×3 the FedSR text says. The 3×3
# network is ``rmnist_cnn`` (28 → 26 → 13 → 11 → 5, flat 1600); ``rmnist_cnn_k5`` has DIVA/DIRT's 5×5 convolutions.
# Both take PyTorch's default initialisation (FedSR does not say). ``rmnist_dirt`` is DIRT's network as its code
# has it (domain_gen_rotatedmnist/models/dirt.py at 2635178): the 5×5 trunk, Xavier-uniform weights and zero
# biases (lines 18-25), and a ReLU between z and the classifier (line 35: ``self.cls(F.relu(z))``).


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
    return trunk, _flat_size(trunk, tuple(input_shape))


def _rmnist(input_shape: tuple[int, ...], latent_dim: int, bounded: bool, kernel_size: int,
            xavier: bool = False) -> nn.Module:
    """The encoder; ``xavier``: DIRT's initialisation, Xavier-uniform convolutions and projection, zero projection
    bias (models/dirt.py 18-21), drawn before the weights are stored channels-last."""
    trunk, flat = rmnist_trunk(input_shape, kernel_size=kernel_size)
    fc = nn.Linear(flat, latent_dim)
    if xavier:
        for weight in (*(m.weight for m in trunk if isinstance(m, nn.Conv2d)), fc.weight):
            nn.init.xavier_uniform_(weight)
        nn.init.zeros_(fc.bias)
    layers: list[nn.Module] = [*trunk, fc]
    if bounded:
        layers.append(nn.Sigmoid())
    # Convolution weights stored channels-last (NHWC): the same values, 1.4-2x faster convolutions on CPU.
    return nn.Sequential(*layers).to(memory_format=torch.channels_last)  # type: ignore[call-overload]


def rmnist_cnn(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """Encoder builder: the paper's network (3×3 convolutions), ending in a bare Linear(1600 → latent_dim)."""
    return _rmnist(input_shape, latent_dim, bounded, kernel_size=3)


def rmnist_cnn_k5(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """Encoder builder: DIVA/DIRT's network (5×5 convolutions), ending in a bare Linear(1024 → latent_dim)."""
    return _rmnist(input_shape, latent_dim, bounded, kernel_size=5)


class ReLULinear(nn.Linear):
    """A linear layer on relu(x): ``F.linear(relu(x), weight, bias)``, DIRT's classifier ``cls(F.relu(z))``.

    An ``nn.Linear`` with the same parameters, so it is exchanged and averaged as a linear head is; only its
    input is rectified. On a latent in [0, 1] (a Sigmoid-bounded encoder) the ReLU is the identity.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(torch.relu(x))
        return out


class _EncoderAndHead(nn.Module):
    """A builder's whole model: an ``encoder`` and its own linear ``head`` (build_model keeps the head)."""

    def __init__(self, encoder: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.encoder(x))
        return logits


def rmnist_dirt(input_shape: tuple[int, ...], latent_dim: int, bounded: bool, num_classes: int = 10) -> nn.Module:
    """Whole-model builder: DIRT's Rotated MNIST network, logits = cls(relu(fc11(trunk(x)))).

    The encoder is the 5×5 trunk and fc11 = Linear(1024 → latent_dim), z = fc11(h) with no activation (a Sigmoid
    when bounded); the head is :class:`ReLULinear` (latent_dim → num_classes), so the classifier sees relu(z).
    Xavier-uniform on both convolutions, fc11 and the classifier, zero biases (DIRT's models/dirt.py 18-25).
    """
    encoder = _rmnist(input_shape, latent_dim, bounded, kernel_size=5, xavier=True)
    cls = ReLULinear(latent_dim, num_classes)
    nn.init.xavier_uniform_(cls.weight)
    nn.init.zeros_(cls.bias)
    return _EncoderAndHead(encoder, cls)


def _torchvision_models(name: str) -> ModuleType:
    try:
        return importlib.import_module("torchvision.models")
    except Exception as exc:  # ImportError, or RuntimeError from a torchvision built for another torch
        raise ModelUnavailableError(
            f"model {name!r} needs torchvision, but torchvision is not importable in this environment "
            f"({type(exc).__name__}: {exc}); install a torchvision build matching your torch "
            f"({torch.__version__}), e.g. use the hetfed GPU client image"
        ) from exc


def resnet18(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """torchvision's ResNet-18 (untrained) with a linear layer to d_e; needs torchvision."""
    c, _, _ = _image_shape("resnet18", input_shape)
    backbone = _torchvision_models("resnet18").resnet18(weights=None)
    if c != 3:
        old = backbone.conv1
        backbone.conv1 = nn.Conv2d(
            c,
            old.out_channels,
            kernel_size=old.kernel_size,
            stride=old.stride,
            padding=old.padding,
            bias=False,
        )
    width = int(backbone.fc.in_features)
    backbone.fc = nn.Identity()
    return nn.Sequential(backbone, nn.Linear(width, latent_dim), _latent_activation(bounded))


def mobilenet_v2(input_shape: tuple[int, ...], latent_dim: int, bounded: bool) -> nn.Module:
    """torchvision's MobileNetV2 (untrained) with a linear layer to d_e; needs torchvision."""
    c, _, _ = _image_shape("mobilenet_v2", input_shape)
    backbone = _torchvision_models("mobilenet_v2").mobilenet_v2(weights=None)
    if c != 3:
        old = backbone.features[0][0]
        backbone.features[0][0] = nn.Conv2d(
            c,
            old.out_channels,
            kernel_size=old.kernel_size,
            stride=old.stride,
            padding=old.padding,
            bias=False,
        )
    width = int(backbone.last_channel)
    backbone.classifier = nn.Identity()
    return nn.Sequential(backbone, nn.Linear(width, latent_dim), _latent_activation(bounded))


class ModelBuilderError(ValueError):
    """An architecture that cannot be built as named: an unknown name, a builder that cannot be imported, that
    raises, or that returns something the algorithms cannot train (docs/models.md lists the contract)."""


OWN_LATENT_DIM = 64
"""The latent width of an organization's own builder that declares none (``builder.latent_dim``) and is given
none (``[model] latent_dim``): hetfed's own choice, the width of the built-in MLP's latent."""


def encoder_builder(model: str) -> EncoderBuilder:
    """The encoder builder ``model`` names: a registered architecture, or an organization's own builder
    ``"package.module:function"`` (its module imported now); ModelBuilderError in one line if it cannot be."""
    if not is_reference(model):
        if model not in MODELS:
            raise ModelBuilderError(f"unknown model {model!r}; available: {', '.join(available_models())}, or an "
                                    "own builder 'package.module:function'")
        model_ref = MODELS[model].builder
    else:
        model_ref = model
    module_name, _, func = model_ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises when imported
        raise ModelBuilderError(f"model builder {model_ref!r}: cannot import module {module_name!r} "
                                f"({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    builder = getattr(module, func, None)
    if not callable(builder):
        raise ModelBuilderError(f"model builder {model_ref!r}: module {module_name!r} has no function {func!r}")
    return builder  # type: ignore[no-any-return]


def default_latent_dim(model: str) -> int:
    """The latent width ``model`` uses unless the run or the organization sets one: the registry's for a
    built-in, ``builder.latent_dim`` for an organization's own builder that declares it, else OWN_LATENT_DIM."""
    if not is_reference(model):
        return MODELS[model].latent_dim if model in MODELS else OWN_LATENT_DIM
    declared = getattr(encoder_builder(model), "latent_dim", OWN_LATENT_DIM)
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise ModelBuilderError(f"model builder {model!r}: its latent_dim attribute must be a positive int, "
                                f"got {declared!r}")
    return declared


def available_models() -> list[str]:
    """Names accepted by :func:`build_model` (besides own builders ``"package.module:function"``)."""
    return list(MODELS)


def _call_builder(model: str, builder: EncoderBuilder, shape: tuple[int, ...], dim: int, bounded: bool,
                  num_classes: int) -> nn.Module:
    """The builder's module; a builder that takes ``num_classes`` (to return a whole model) is given it."""
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    kwargs = {"num_classes": num_classes} if "num_classes" in params else {}
    try:
        return builder(shape, dim, bounded, **kwargs)
    except (ModelBuilderError, ModelUnavailableError):
        raise
    except Exception as exc:
        raise ModelBuilderError(f"model builder {model!r} raised {type(exc).__name__} for input shape {shape}, "
                                f"latent_dim {dim}: {' '.join(str(exc).split())}") from None


def make_built(model: str, input_shape: tuple[int, ...], latent_dim: int, bounded: bool,
               num_classes: int) -> nn.Module:
    """The module ``model``'s builder makes, under the caller's RNG state: an encoder, or a whole model (an
    ``encoder`` and a linear ``head``, see :func:`split_whole`)."""
    built = _call_builder(model, encoder_builder(model), tuple(input_shape), latent_dim, bounded, num_classes)
    if not isinstance(built, nn.Module):
        raise ModelBuilderError(f"model builder {model!r} returned {type(built).__name__}, not a torch.nn.Module")
    return built


def make_encoder(model: str, input_shape: tuple[int, ...], latent_dim: int, bounded: bool,
                 num_classes: int) -> nn.Module:
    """The encoder ``model``'s builder makes, under the caller's RNG state (a whole model's ``encoder``)."""
    return split_whole(make_built(model, input_shape, latent_dim, bounded, num_classes))[0]


def _is_whole(built: nn.Module) -> bool:
    """Whether a builder returned a whole model (an ``encoder`` module and a linear ``head``)."""
    return isinstance(built, SplitModel) or (hasattr(built, "encoder") and isinstance(getattr(built, "head", None),
                                                                                         nn.Linear))


def split_whole(built: nn.Module) -> tuple[nn.Module, nn.Linear | None]:
    """A builder's module as (encoder, its own head): a whole model's two parts, else (the module, None)."""
    if _is_whole(built):
        return built.encoder, built.head  # type: ignore[return-value]
    return built, None


def _probe(model: str, encoder: nn.Module, shape: tuple[int, ...], dim: int, bounded: bool) -> None:
    """Check the encoder on a probe batch of two inputs: output (2, latent_dim), finite, in [0, 1] if bounded."""
    probe = torch.rand((2, *shape), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), eval_mode(encoder):
            z = encoder(probe)
    except Exception as exc:
        raise ModelBuilderError(f"model {model!r}: the encoder fails on a probe batch of shape {tuple(probe.shape)} "
                                f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from None
    if not isinstance(z, torch.Tensor) or tuple(z.shape) != (2, dim):
        got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ModelBuilderError(f"model {model!r}: the encoder must map a batch of inputs {shape} to (batch, "
                                f"latent_dim) = (2, {dim}) on a probe batch, got {got}")
    if not bool(torch.isfinite(z).all()):
        raise ModelBuilderError(f"model {model!r}: the encoder's output on a probe batch is not finite")
    if bounded and not bool(((z >= 0) & (z <= 1)).all()):
        raise ModelBuilderError(f"model {model!r}: this algorithm needs a bounded latent in [0, 1] (the builder's "
                                "bounded_latent argument is True: end the encoder with nn.Sigmoid()), got values in "
                                f"[{float(z.min()):.3g}, {float(z.max()):.3g}]")


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    latent_dim: int | None = None,
    bounded_latent: bool = False,
    seed: int = 0,
) -> SplitModel:
    """Build an architecture on CPU, with initial weights fixed by ``seed`` (the same in every process).

    ``name`` is a registered architecture or an organization's own builder ``"package.module:function"``; both
    go through the same path: the builder makes the encoder (or a whole model with ``encoder`` and a linear
    ``head``), hetfed checks it on a probe batch and adds the head. ``bounded_latent`` asks the encoder to end
    in a Sigmoid so that z lies in [0, 1]^latent_dim (Fed-CMA). The global torch RNG state is left as it was.
    """
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    builder = encoder_builder(name)
    dim = default_latent_dim(name) if latent_dim is None else int(latent_dim)
    if dim < 1:
        raise ValueError(f"latent_dim must be >= 1, got {latent_dim}")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(int(seed))
        built = _call_builder(name, builder, shape, dim, bounded_latent, int(num_classes))
        if not isinstance(built, nn.Module):
            raise ModelBuilderError(f"model builder {name!r} returned {type(built).__name__}, not a torch.nn.Module")
        if _is_whole(built):
            return _whole(name, built, shape, dim, bounded_latent, int(num_classes))
        _probe(name, built, shape, dim, bounded_latent)
        return SplitModel(built, dim, int(num_classes))


def _whole(name: str, built: nn.Module, shape: tuple[int, ...], dim: int, bounded: bool,
           num_classes: int) -> SplitModel:
    """A builder's whole model (``encoder`` and a linear ``head``) as a SplitModel, its own head kept."""
    encoder, head = built.encoder, built.head
    if not isinstance(encoder, nn.Module) or not isinstance(head, nn.Linear):
        raise ModelBuilderError(f"model builder {name!r} returned a whole model whose encoder is not a module or "
                                "whose head is not an nn.Linear")
    if (head.in_features, head.out_features) != (dim, num_classes):
        raise ModelBuilderError(f"model builder {name!r}: its head is Linear({head.in_features}, "
                                f"{head.out_features}), the run needs Linear(latent_dim={dim}, "
                                f"num_classes={num_classes})")
    _probe(name, encoder, shape, dim, bounded)
    model = SplitModel(encoder, dim, num_classes)
    model.head = head
    return model


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (all, or only those with requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def state_arrays(module: nn.Module) -> dict[str, np.ndarray]:
    """Numpy copies of ``module.state_dict()``: floating tensors as float32, others keep their dtype (e.g. int64)."""
    out: dict[str, np.ndarray] = {}
    for key, tensor in module.state_dict().items():
        t = tensor.detach().cpu()
        if t.is_floating_point():
            t = t.to(torch.float32)
        out[key] = t.numpy().copy()
    return out


def load_state_arrays(module: nn.Module, arrays: Mapping[str, np.ndarray], *, strict: bool = True) -> None:
    """Copy arrays into ``module``'s parameters and buffers in place (the inverse of :func:`state_arrays`).

    With ``strict`` the keys must match exactly; without it, missing keys keep their current values and
    unexpected keys are ignored. A shape mismatch is always an error, and nothing is copied on any error.
    """
    state = module.state_dict()
    missing = sorted(set(state) - set(arrays))
    unexpected = sorted(set(arrays) - set(state))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(unexpected)}")
        raise ValueError(f"state arrays do not match {type(module).__name__}: " + "; ".join(parts))
    shaped = []
    for key, target in state.items():
        if key in arrays:
            shape = tuple(np.shape(arrays[key]))
            if shape != tuple(target.shape):
                shaped.append(f"{key}: expected {tuple(target.shape)}, got {shape}")
    if shaped:
        raise ValueError("state arrays have the wrong shape for " + "; ".join(shaped))
    with torch.no_grad():
        for key, target in state.items():
            if key in arrays:
                target.copy_(torch.tensor(np.asarray(arrays[key])).to(dtype=target.dtype))
