"""The example's three encoder builders: hetfed's builder contract, small and plain, and SimFed can factorise them."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from hetfed_example import models
from torch import nn

from hetfed.client.algorithms.simfed.layers import FactorizedConv2d, FactorizedLinear, factorize_model
from hetfed.client.models import SplitModel, build_model, default_latent_dim

BUILDERS: dict[str, Callable[[tuple[int, ...], int, bool], nn.Module]] = {
    "resnet": models.resnet, "dsconv": models.dsconv, "mixer": models.mixer,
}
NAMES = list(BUILDERS)


def _reference(name: str) -> str:
    return f"hetfed_example.models:{name}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8), (2, 20, 36)])
def test_the_encoder_maps_a_batch_to_the_latent(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    encoder = BUILDERS[name](shape, 24, False)
    z = encoder(torch.rand(5, *shape))
    assert z.shape == (5, 24)
    assert bool((z >= 0).all())  # ReLU when unbounded


@pytest.mark.parametrize("name", NAMES)
def test_a_bounded_latent_lies_in_the_unit_interval_and_ends_in_a_sigmoid(name: str) -> None:
    torch.manual_seed(0)
    encoder = BUILDERS[name]((1, 28, 28), 16, True)
    z = encoder(10 * torch.randn(8, 1, 28, 28))
    assert z.shape == (8, 16)
    assert bool(((z >= 0) & (z <= 1)).all())
    last = list(encoder.modules())[-1]
    assert isinstance(last, nn.Sigmoid)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 7, 28), (1, 28), (0, 28, 28)])
def test_a_too_small_or_non_image_input_is_refused_with_the_builders_name(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=rf"{name} needs an image input"):
        BUILDERS[name](shape, 16, False)


@pytest.mark.parametrize("name", NAMES)
def test_each_builder_is_under_60_lines_and_declares_the_latent_width(name: str) -> None:
    lines = inspect.getsource(BUILDERS[name]).splitlines()
    assert len(lines) < 60
    assert default_latent_dim(_reference(name)) == models.LATENT_DIM == 64


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_stay_modest_on_fashion_mnist(name: str) -> None:
    encoder = BUILDERS[name]((1, 28, 28), 64, False)
    assert 20_000 < sum(p.numel() for p in encoder.parameters()) <= 150_000


def test_the_three_are_different_architectures() -> None:
    kinds = {name: {type(m) for m in BUILDERS[name]((1, 28, 28), 64, False).modules()} for name in NAMES}
    assert models.BasicBlock in kinds["resnet"] and nn.BatchNorm2d in kinds["resnet"]
    dsconv = BUILDERS["dsconv"]((1, 28, 28), 64, False)
    depthwise = [m for m in dsconv.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert depthwise and all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    assert any(isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) for m in dsconv.modules())
    assert {models.MixerBlock, nn.LayerNorm} <= kinds["mixer"] and nn.BatchNorm2d not in kinds["mixer"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bounded", [False, True])
def test_hetfed_builds_them_by_reference(name: str, bounded: bool) -> None:
    model = build_model(_reference(name), (1, 28, 28), 10, bounded_latent=bounded)
    again = build_model(_reference(name), (1, 28, 28), 10, bounded_latent=bounded)
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the same seed gives the same weights in every process
    assert isinstance(model, SplitModel) and model.latent_dim == 64
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)


@pytest.mark.parametrize("name", NAMES)
def test_simfed_factorises_every_linear_and_convolution_of_the_encoder(name: str) -> None:
    model = build_model(_reference(name), (1, 28, 28), 10, latent_dim=32)
    dense = [m for m in model.encoder.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    factorised = factorize_model(model, seed=3)
    replaced = [m for m in factorised.encoder.modules() if isinstance(m, FactorizedLinear | FactorizedConv2d)]
    assert len(replaced) == len(dense) > 0
    assert not [m for m in factorised.encoder.modules() if type(m) in (nn.Linear, nn.Conv2d)]
    x = torch.rand(4, 1, 28, 28)
    logits = factorised(x)
    assert logits.shape == (4, 10) and bool(torch.isfinite(logits).all())
    logits.sum().backward()
    assert all(p.grad is not None for p in factorised.encoder.parameters() if p.requires_grad)
